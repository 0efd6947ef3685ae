from producer_service.progress import ProgressTracker


def test_confirms_only_transactions_whose_packages_were_all_acked():
    tracker = ProgressTracker()
    first = tracker.begin()
    tracker.hold(first)  # a buffer got an event of the first transaction
    tracker.commit(end_lsn=100)
    second = tracker.begin()
    tracker.hold(second)
    tracker.commit(end_lsn=200)
    assert tracker.confirmed_lsn == 0
    tracker.release(second)  # acks may arrive out of order
    assert tracker.confirmed_lsn == 0
    tracker.release(first)
    assert tracker.confirmed_lsn == 200


def test_never_confirms_inside_an_open_transaction():
    tracker = ProgressTracker()
    ordinal = tracker.begin()
    tracker.hold(ordinal)
    tracker.release(ordinal)  # a package of a large transaction was acked before its commit arrived
    assert tracker.confirmed_lsn == 0
    tracker.commit(end_lsn=500)
    assert tracker.confirmed_lsn == 500


def test_a_transaction_without_events_completes_at_commit():
    tracker = ProgressTracker(start_lsn=10)
    tracker.begin()
    tracker.commit(end_lsn=40)
    assert tracker.confirmed_lsn == 40


def test_idle_position_moves_only_when_nothing_is_in_flight():
    tracker = ProgressTracker()
    ordinal = tracker.begin()
    tracker.hold(ordinal)
    tracker.commit(end_lsn=100)
    tracker.idle_position(900)
    assert tracker.confirmed_lsn == 0
    tracker.release(ordinal)
    tracker.idle_position(900)
    assert tracker.confirmed_lsn == 900


def test_a_pending_earlier_transaction_blocks_later_ones():
    tracker = ProgressTracker()
    ordinals = []
    for end in (10, 20, 30):
        ordinal = tracker.begin()
        tracker.hold(ordinal)
        ordinals.append(ordinal)
        tracker.commit(end_lsn=end)
    tracker.release(ordinals[0])
    assert tracker.confirmed_lsn == 10
    tracker.release(ordinals[2])
    assert tracker.confirmed_lsn == 10
    tracker.release(ordinals[1])
    assert tracker.confirmed_lsn == 30
    assert tracker.in_flight == 0
