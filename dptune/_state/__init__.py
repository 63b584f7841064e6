"""What a run keeps on disk: the curator's journal, the dataset budget ledger, the workdir lock
and the owner-only, checked SQLite files under them. Internal: the public names are
``dptune.Journal``, ``dptune.Ledger`` and the errors they raise."""
