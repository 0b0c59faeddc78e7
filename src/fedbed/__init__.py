"""FedBed: federated domain generalization on one engine, in-process or on Flower."""

__version__ = "0.1.0"
