"""The embedded ClickHouse server: one process owns a chdb data directory and answers the part of
ClickHouse's HTTP interface that clickhouse-connect uses, so many processes can share it."""
