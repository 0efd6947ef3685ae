"""The embedded ClickHouse server: one process owns a chdb data directory and answers the part of
ClickHouse's HTTP interface that clickhouse-connect uses, so many processes can share it."""

# The server's password, read from the environment, never from the command line (which `ps` shows).
PASSWORD_VARIABLE = "SIPHON_CLICKHOUSE_SERVER_PASSWORD"
