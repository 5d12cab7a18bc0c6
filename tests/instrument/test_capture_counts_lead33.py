"""``capture vllm``'s closing counts read as words: each noun singular at 1, thousands separated
(live33's report: "1 bad messages", "1 restarts", "1 unknown events")."""

from __future__ import annotations

from kvtrace.instrument.vllm.capture import CaptureStats, capture_counts


def test_each_count_takes_its_nouns_number():
    one = CaptureStats(batches=1, events=1, spans=1, recovered=1, lost=1, missed_before_contact=1, duplicates=1,
                       restarts=1, bad_messages=1, unknown_events=1, connected=1)
    assert capture_counts(one) == ("1 batch, 1 event, 1 span, 1 recovered, 1 lost, 1 missed before contact, "
                                   "1 duplicate, 1 restart, 1 bad message, 1 unknown event")
    many = CaptureStats(batches=4210, events=2, spans=3, restarts=2, bad_messages=1_000, connected=1)
    assert capture_counts(many) == "4,210 batches, 2 events, 3 spans, 2 restarts, 1,000 bad messages"
