"""The sessions service: logins (password, OIDC), sessions in NATS KV, users, API tokens, the audit log.
The API is documented in :mod:`.service`; operators read docs/security.md."""
