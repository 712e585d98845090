"""Studies: a study file's arms, seeds and claims and a sweep root's run directories (`study`),
the sweep runner (`sweep`) and the provenance it records per run (`provenance`), the
statistics (`stats`), the report (`report`) and the probes of every run of a study
(`study_probes`). Above the trainer and the instruments: nothing else in the
library imports it."""
