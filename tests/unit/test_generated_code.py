from siphon_core.wire import generate


def test_generated_protobuf_code_matches_the_proto_file():
    assert generate.stale_files() == [], "run `python -m siphon_core.wire.generate` and commit the result"
