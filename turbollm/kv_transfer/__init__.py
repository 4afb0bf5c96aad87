"""Moving K/V blocks in and out of an engine: the block store's files (`block_store.py`). The connector's
config and per-step plain data are `handoff/kv_transfer.py`; its halves are core/ and worker/ `kv_connector.py`."""
