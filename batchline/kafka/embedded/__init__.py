"""What exists only because of the embedded broker (tansu 0.6, docs/brokers.md): imported and built only when
:func:`batchline.kafka.broker_mode.quirks_for` chooses embedded mode, through :mod:`.quirks`, and nowhere else.

- :mod:`.aborted`: aborted records, and each partition's last stable offset, read from the log itself (its
  read_committed delivers aborted records and answers a wrong end while a transaction is open);
- :mod:`.takeover`: a newly assigned partition waits for the transactions open on the group's outputs (its offset
  fetch does not);
- :mod:`.ghost_leader`: a member leaves its group only once the group is stable (a leader leaving a re-forming group
  jams it), and a sampler of the group's state tells when a member is stuck.

- :mod:`.rejoin`: no claim holds while a rejoin left behind by its group lasts (the broker hands a late rejoiner its
  partitions back without a word), fed by librdkafka's statistics.

- :mod:`.quirks`: the embedded broker's quirks object, which builds the above for a group member
  (:mod:`batchline.kafka.membership`: the worker, the streams' holding members, the ledger) and for the one-shot
  readers (:mod:`batchline.kafka.scan`).
"""
