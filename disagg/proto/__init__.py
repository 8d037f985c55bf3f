"""The control plane's wire format: stubs generated from proto/disagg.proto (regenerate them with
`python -m disagg.proto.generate`), and `convert`, between its messages and the dataclasses."""

SERVICE_NAME = "disagg.v1.PrefillService"
# gRPC metadata key of the shared secret between nodes (kv_connector_extra_config.auth_token).
AUTH_METADATA_KEY = "x-disagg-auth-token"
