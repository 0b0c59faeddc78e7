"""FedBed on Flower: any registered method on Flower's simulation engine or real SuperNodes.

``records`` maps :class:`~fedbed.federation.messages.Payload` / ``Reply`` to Flower's records;
``apps`` holds the ServerApp and ClientApp that drive any ServerStrategy / ClientTrainer;
``simulation`` runs a job on Flower's simulation engine (``flower-sim``), ``deployment`` on a
SuperLink with one SuperNode per client on this machine (``flower-deployment``); ``common`` holds
what they share. :mod:`fedbed.backends` chooses between them and the in-process run.
``strategies`` is the other direction: FedBed's server rules as Flower strategies for any
Flower app's own clients (no run of FedBed imports it).
"""
