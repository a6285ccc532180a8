"""Files on disk: atomic writes (:mod:`.atomic_file`), free space (:mod:`.disk`), checksummed
manifests of checkpoint directories (:mod:`.manifest`) and the recover-checkpoint layout
(:mod:`.recover`)."""
