"""The seams every method is built on: the registry (:mod:`.registry`), the supervised client
trainer (:mod:`.local_training`), the averaging server and its aggregation seam
(:mod:`.model_aggregation`), the update aggregators' base (:mod:`.update_aggregation`) and the
self-supervised machinery (:mod:`.self_supervised`, :mod:`.self_supervised_objectives`)."""
