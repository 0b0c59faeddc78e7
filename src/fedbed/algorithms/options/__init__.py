"""Run options that ``fedbed.build`` wires around any method that allows them: robust aggregation
(:mod:`.robust_aggregation`), client-level differential privacy (:mod:`.differential_privacy`)
and the knowledge vote of domain adaptation (:mod:`.knowledge_vote`)."""
