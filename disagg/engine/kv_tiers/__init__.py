"""The KV tiers under the device block pool: host memory and disk (offload.py owns them)."""
