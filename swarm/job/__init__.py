"""A job as every role reads it: the schema (`schema`), the coercion of TOML values into it
(`coerce`), its fingerprint and file hashes (`fingerprint`), parsing (`config`), the data pinned
to its contents (`pinning`), and the names of job and peer states (`states`)."""
