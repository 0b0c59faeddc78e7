"""Model architectures with separate featurizer and classifier."""

from fedbed.models.networks import (
    FIXED_INPUT_SIZES,
    HEAD_PREFIX,
    MODELS,
    DomainClassifier,
    ModelError,
    build_model,
    model_refusal,
)

__all__ = ["FIXED_INPUT_SIZES", "HEAD_PREFIX", "MODELS", "DomainClassifier", "ModelError", "build_model", "model_refusal"]
