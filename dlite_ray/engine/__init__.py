"""Engine: sequences, block manager, scheduler, the DLite round and the library API."""
