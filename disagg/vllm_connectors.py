"""vLLM's KV connector names in `--kv-transfer-config`, onto disagg's pipes and KV tiers.

vLLM picks a connector class by name; disagg has pipes (which move a prompt's KV from a prefill
node to a decode node) and KV tiers (host memory and disk under the device cache). So:

    PyNcclConnector, P2pNcclConnector    -> the torch_dist pipe (NCCL between GPUs, gloo on CPU)
    NixlConnector                        -> the nixl pipe
    OffloadingConnector,
    SimpleCPUOffloadConnector            -> the host tier (--kv-offloading-size, --kv-offloading-mode)
    LMCacheConnector, LMCacheConnectorV1 -> the host tier, and the disk tier when LMCache's config has one
    MultiConnector                       -> each of its `connectors`: at most one pipe, plus tiers

`translate` turns such fields into ours (imports nothing heavy: the command line uses it).
"""

import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

logger = logging.getLogger(__name__)

PIPE_CONNECTORS = {"PyNcclConnector": "torch_dist", "P2pNcclConnector": "torch_dist", "NixlConnector": "nixl"}
OFFLOADING_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")
LMCACHE_CONNECTORS = ("LMCacheConnector", "LMCacheConnectorV1")
VLLM_CONNECTORS = (*PIPE_CONNECTORS, *OFFLOADING_CONNECTORS, *LMCACHE_CONNECTORS, "MultiConnector")
# kv_connector_extra_config fields of vLLM's connectors that mean nothing here (a proxy's address,
# NCCL tuning, a spec class): accepted, so that vLLM's command lines start, with a warning.
IGNORED_EXTRA = {
    "PyNcclConnector": (),
    "P2pNcclConnector": ("proxy_ip", "proxy_port", "http_port", "send_type", "nccl_num_channels",
                         "mem_pool_size_gb"),
    "NixlConnector": ("backends",),
    "OffloadingConnector": ("spec_name", "spec_module_path", "block_size"),
    "SimpleCPUOffloadConnector": (),
}
GIB = 2**30
# LMCache's settings that map onto our tiers (its names; sizes in GiB). LMCache's default host size is 5 GiB.
LMCACHE_DEFAULT_CPU_GIB = 5.0
LMCACHE_TIER_KEYS = ("local_cpu", "max_local_cpu_size", "max_local_cache_size", "local_disk", "local_device",
                     "max_local_disk_size")


@dataclass
class KVTiers:
    """The KV tiers a connector asks for, as disagg's engine settings (None: not said)."""
    kv_offloading_size: float | None = None  # GiB of host memory
    kv_offloading_mode: str | None = None  # "eager" or "lazy"
    kv_disk_path: str | None = None
    kv_disk_size: float | None = None  # GiB

    def merge(self, other: "KVTiers") -> "KVTiers":
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"--kv-transfer-config: two connectors give {f.name} ({mine} and {theirs}); give one")
            if theirs is not None:
                setattr(self, f.name, theirs)
        return self

    def asks(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


def translate(fields_: dict) -> tuple[dict, KVTiers]:
    """--kv-transfer-config's fields as vLLM writes them -> (our fields, the tiers asked for). Fields
    with one of our pipe names (or none) come back as they were."""
    name = fields_.get("kv_connector")
    if name not in VLLM_CONNECTORS:
        return fields_, KVTiers()
    out = dict(fields_)
    extra = dict(out.pop("kv_connector_extra_config", None) or {})
    tiers = KVTiers()
    if name == "MultiConnector":
        pipe = None
        for sub in extra.pop("connectors", None) or []:
            if not isinstance(sub, dict):
                raise ValueError("--kv-transfer-config: MultiConnector's connectors must be JSON objects")
            sub_fields, sub_tiers = translate({"kv_role": out.get("kv_role", "both"), **sub})
            tiers.merge(sub_tiers)
            if sub.get("kv_connector") in PIPE_CONNECTORS:
                if pipe is not None:
                    raise ValueError("--kv-transfer-config: MultiConnector names two pipes "
                                     f"({pipe} and {sub_fields['kv_connector']}); disagg moves KV over one")
                pipe = sub_fields["kv_connector"]
                extra = {**sub_fields.get("kv_connector_extra_config", {}), **extra}
        out["kv_connector"] = pipe or "tcp"
    elif name in PIPE_CONNECTORS:
        out["kv_connector"] = PIPE_CONNECTORS[name]
        ignored = sorted(k for k in extra if k in IGNORED_EXTRA[name])
        if ignored:
            logger.warning("--kv-transfer-config: %s's %s mean nothing here and are ignored", name, ignored)
        extra = {k: v for k, v in extra.items() if k not in IGNORED_EXTRA[name]}
        if name == "P2pNcclConnector" and "kv_buffer_size" in out:
            # There it is the sender's threshold for buffering (its recipes write "1e1"), not a buffer size.
            logger.warning("--kv-transfer-config: P2pNcclConnector's kv_buffer_size (%s) is its sender's "
                           "threshold and is ignored; the buffer keeps its default", out.pop("kv_buffer_size"))
        if out.get("kv_role") in ("both", "kv_both"):
            logger.warning("--kv-transfer-config: %s with kv_role kv_both: vLLM's proxy picks each request's "
                           "prefill node; disagg's nodes have fixed roles, so this one is colocated and moves "
                           "no KV (kv_producer and kv_consumer disaggregate)", name)
    else:
        out["kv_connector"] = "tcp"  # the pipe of a node that has only tiers: unused unless it disaggregates
        tiers = (offloading_tiers(name, extra) if name in OFFLOADING_CONNECTORS else lmcache_tiers(extra))
        extra = {k: v for k, v in extra.items() if k in ("auth_token",)}
    if extra:
        out["kv_connector_extra_config"] = extra
    return out, tiers


def offloading_tiers(name: str, extra: dict) -> KVTiers:
    """vLLM's OffloadingConnector (cpu_bytes_to_use) and SimpleCPUOffloadConnector (cpu_bytes_to_use_per_rank,
    lazy_offload): the host tier."""
    if "num_cpu_blocks" in extra:
        raise ValueError(f"--kv-transfer-config: {name}'s num_cpu_blocks is not taken here: give "
                         "kv_connector_extra_config.cpu_bytes_to_use (bytes) or --kv-offloading-size GIB")
    ignored = sorted(k for k in extra if k in IGNORED_EXTRA[name])
    if ignored:
        logger.warning("--kv-transfer-config: %s's %s mean nothing here and are ignored", name, ignored)
    known = {"cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "lazy_offload", "auth_token", *IGNORED_EXTRA[name]}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"--kv-transfer-config: {name}'s kv_connector_extra_config has unknown field(s) {unknown}; "
                         "known: cpu_bytes_to_use, cpu_bytes_to_use_per_rank, lazy_offload")
    tiers = KVTiers()
    size = extra.get("cpu_bytes_to_use", extra.get("cpu_bytes_to_use_per_rank"))  # one rank here: the same
    if size is not None:
        tiers.kv_offloading_size = float(size) / GIB
    if "lazy_offload" in extra:
        if not isinstance(extra["lazy_offload"], bool):
            raise ValueError(f"--kv-transfer-config: lazy_offload must be true or false, got {extra['lazy_offload']!r}")
        tiers.kv_offloading_mode = "lazy" if extra["lazy_offload"] else "eager"
    return tiers


def lmcache_tiers(extra: dict) -> KVTiers:
    """LMCache's local CPU and local disk backends as our host and disk tiers. Its settings come, as
    LMCache reads them, from $LMCACHE_CONFIG_FILE (YAML), then $LMCACHE_<NAME>, then the connector's
    extra config (with or without the "lmcache." prefix); the older names max_local_cache_size and
    local_device are read too. What has no counterpart here (chunk_size, remote_url, P2P) is ignored."""
    settings: dict = {}
    path = os.environ.get("LMCACHE_CONFIG_FILE")
    if path:
        import yaml

        try:
            loaded = yaml.safe_load(Path(path).expanduser().read_text()) or {}
        except OSError as e:
            raise ValueError(f"$LMCACHE_CONFIG_FILE: cannot read {path}: {e.strerror}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"$LMCACHE_CONFIG_FILE: {path} is not a YAML mapping")
        settings.update(loaded)
    for key in LMCACHE_TIER_KEYS:
        if f"LMCACHE_{key.upper()}" in os.environ:
            settings[key] = os.environ[f"LMCACHE_{key.upper()}"]
    settings.update({k.removeprefix("lmcache."): v for k, v in extra.items() if k != "auth_token"})
    ignored = sorted(k for k in settings if k not in LMCACHE_TIER_KEYS)
    if ignored:
        logger.warning("LMCache settings %s have no counterpart in disagg's KV tiers and are ignored", ignored)
    if str(settings.get("local_cpu", True)).lower() in ("false", "0", "no"):
        raise ValueError("LMCache's local_cpu is false: disagg's disk tier sits under a host tier; leave "
                         "local_cpu on (max_local_cpu_size GiB)")
    tiers = KVTiers(kv_offloading_size=gib(settings.get("max_local_cpu_size",
                                                        settings.get("max_local_cache_size", LMCACHE_DEFAULT_CPU_GIB))))
    disk = settings.get("local_disk")
    device = str(settings.get("local_device") or "")
    if disk is None and device.startswith("/"):
        disk = device
    if disk:
        tiers.kv_disk_path = str(disk).removeprefix("file://")
        tiers.kv_disk_size = gib(settings.get("max_local_disk_size", 0)) or None
    return tiers


def gib(value: object) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"LMCache size {value!r} is not a number of GiB") from None


def merge_fields(text: str | None, connector: str | None, extra_text: str | None) -> str | None:
    """--kv-transfer-config's JSON with --kv-connector and --kv-connector-extra-config (the spelling of
    the seed documents' command lines) folded in; a field given twice must agree."""
    if connector is None and extra_text is None:
        return text
    try:
        fields_ = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(fields_, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    if connector is not None:
        if fields_.get("kv_connector", connector) != connector:
            raise ValueError(f"--kv-connector {connector} disagrees with kv_connector "
                             f"{fields_['kv_connector']!r} in --kv-transfer-config")
        fields_["kv_connector"] = connector
    if extra_text is not None:
        try:
            extra = json.loads(extra_text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-connector-extra-config is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--kv-connector-extra-config must be a JSON object")
        fields_["kv_connector_extra_config"] = {**(fields_.get("kv_connector_extra_config") or {}), **extra}
    return json.dumps(fields_)
