"""What exists only because of the embedded broker (tansu 0.6, docs/brokers.md): built where
:attr:`batchline.kafka.settings.KafkaSettings.embedded` says so (``BATCHLINE_BROKER``), and nowhere else.

- :mod:`.aborted`: aborted records read from the log itself (its read_committed delivers them);
- :mod:`.takeover`: a newly assigned partition waits for the transactions open on the group's outputs (its offset
  fetch does not).

Still outside this package (correct on Apache Kafka, at a cost; docs/brokers.md lists them): the stable leave in
:mod:`batchline.kafka.groups` (skipped off embedded mode), the quiet end of reads in :mod:`batchline.kafka.scan`
and the rejoin rule of :mod:`batchline.kafka.ownership`.
"""
