"""The streaming apply engine: JetStream packages -> Spark decode and fold -> a target, acked after commit.

Independent of Dagster: a streaming job builds a `StreamConsumer` and calls `run`.
"""
