"""What exists only because of the embedded broker (tansu 0.6, docs/brokers.md): built where
:attr:`batchline.kafka.settings.KafkaSettings.embedded` says so (``BATCHLINE_BROKER``), and nowhere else.

- :mod:`.aborted`: aborted records, and each partition's last stable offset, read from the log itself (its
  read_committed delivers aborted records and answers a wrong end while a transaction is open);
- :mod:`.takeover`: a newly assigned partition waits for the transactions open on the group's outputs (its offset
  fetch does not).

Still outside this package: the stable leave and the group sampler in :mod:`batchline.kafka.groups` and the
statistics that feed the rejoin rule of :mod:`batchline.kafka.ownership` (each skipped off embedded mode). Every one
of them is built in one place, :class:`batchline.kafka.membership.Membership`, for the worker and the streams alike.
"""
