"""Asset checks on every target asset: schema parity, row count, row parity and freshness.

`definitions.build_asset_checks` declares them; `siphon-dagster check` and the `<group>_checks`
schedule run them through Dagster, so every result is recorded on its asset.
"""
