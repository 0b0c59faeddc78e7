"""Datasets, leave-one-domain-out splits and client partitions."""

from fedbed.data.base import DataError, DatasetSpec, DomainDataset
from fedbed.data.catalog import (
    DATASETS,
    ENTRY_POINT_GROUP,
    dataset_spec,
    known_datasets,
    load_dataset,
    prepare_dataset,
    register_dataset,
    resolve_data_root,
    with_found_domains,
)
from fedbed.data.splits import (
    ClientPartition,
    add_few_shot_target_samples,
    DomainSplit,
    partition_dirichlet,
    partition_domains_per_client,
    partition_lambda_mix,
    partition_one_client_per_domain,
    partition_pooled,
    split_leave_one_domain_out,
    split_target_for_adaptation,
)

__all__ = [
    "DATASETS",
    "ClientPartition",
    "add_few_shot_target_samples",
    "DataError",
    "DatasetSpec",
    "DomainDataset",
    "ENTRY_POINT_GROUP",
    "DomainSplit",
    "dataset_spec",
    "known_datasets",
    "load_dataset",
    "partition_dirichlet",
    "partition_domains_per_client",
    "partition_lambda_mix",
    "partition_one_client_per_domain",
    "partition_pooled",
    "prepare_dataset",
    "register_dataset",
    "resolve_data_root",
    "split_leave_one_domain_out",
    "split_target_for_adaptation",
    "with_found_domains",
]
