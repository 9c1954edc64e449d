"""faust-streaming apps: the retry scheduler and the completion ledger."""
