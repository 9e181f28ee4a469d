"""Megatron checkpoints: one directory format for trainer runs, SFT and qarl-convert, written atomically.

    format.py           the directory's files, the extra-state keys readers share, completeness, the side-state
                        rule and the per-file digests its marker records
    trust.py            what a reader believes of a directory: the marker, sizes and sha256, no code in its pickles
    ranks.py            the collectives a save, a load and a resume agree by (no-ops in one process)
    save_load.py        the one atomic save and the one verified load, at any TP/EP
    tensor_reader.py    a checkpoint's model tensors a few at a time (the converter's streamed reads)
    run_checkpoints.py  a trainer run's step_XXXXXXXX/ checkpoints: save, prune its own, resume

CheckpointError is errors.py's, the one hf_io raises too.
"""
