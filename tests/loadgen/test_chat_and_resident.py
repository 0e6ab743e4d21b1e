"""Pure parts of the prefix workloads: chat conversations (lengths, expected cached tokens, token ids) and the
resident copies of a shared prompt computed from the requests' holds."""

from __future__ import annotations

from kvpool_client.loadgen.chat import (
    SEALING_TOKENS,
    ChatConversation,
    conversation_token_ids,
    make_chat_conversation,
)
from kvpool_client.loadgen.resident import copies_over_time, resident_copies_summary
from kvpool_client.loadgen.workload import distribution


def test_a_conversation_grows_turn_by_turn():
    conv = ChatConversation(0, turn_tokens=10, output_lens=(7, 20, 5))
    assert [conv.prompt_len(k) for k in range(3)] == [10, 27, 57]
    assert [conv.end_len(k) for k in range(3)] == [17, 47, 62]
    assert conv.sequence_len(2) == 62 + SEALING_TOKENS == conv.max_total_len
    # turn k starts with the blocks the previous turn filled (and sealed): end_len(k - 1) // 16 blocks
    assert [conv.expected_cached_tokens(k, 16) for k in range(3)] == [0, 16, 32]


def test_conversations_are_deterministic_and_their_ids_repeat_across_turns():
    dist = distribution("uniform", 40)
    a = [make_chat_conversation(3, i, dist, 4, 12) for i in range(20)]
    assert a == [make_chat_conversation(3, i, dist, 4, 12) for i in range(20)]
    assert all(c.num_turns == 4 and min(c.output_lens) >= 1 for c in a)
    # the id at a position depends on (seed, conversation, position) only: turn 2's prompt repeats turn 1's tokens
    assert (conversation_token_ids(3, 5, 0, 100)[40:] == conversation_token_ids(3, 5, 40, 100)).all()
    assert (conversation_token_ids(3, 5, 0, 50) != conversation_token_ids(3, 6, 0, 50)).any()


def test_shared_blocks_are_one_copy_and_own_blocks_are_one_each():
    holds = [
        (0.0, 10.0, 0, [17, 18, 19], 0),  # A computed the prompt (cold)
        (1.0, 4.0, 0, [17, 18, 19], 3),  # B found it cached: the same blocks
        (2.0, 6.0, 0, [40, 41, 42], 0),  # C started before A sealed: its own copy (cold)
        (7.0, 9.0, 0, [17, 18, 19], 3),  # D, once warm
        (0.5, 3.0, 1, [5, 6], 0),  # another prompt
    ]
    series = copies_over_time(holds)
    #                    t = 0  1  2  4  6  7  9  10
    assert series[0]["copies"] == [1, 1, 2, 2, 1, 1, 1, 0]
    assert series[0]["requests"] == [1, 2, 3, 2, 1, 2, 1, 0]
    summary = resident_copies_summary(holds, 0.0, 10.0)
    assert summary["0"]["peak_copies"] == 2 and summary["0"]["peak_copies_among_hits"] == 1
    assert summary["0"]["cold_requests"] == 2 and summary["0"]["peak_requests"] == 3
    # held the whole window: 2 copies from 2 to 6, 1 otherwise
    assert summary["0"]["mean_copies"] == (1 * 6 + 2 * 4) / 10
    assert summary["1"] == {"peak_copies": 1, "peak_copies_among_hits": None, "cold_requests": 1,
                            "mean_copies": 1.0, "peak_requests": 1, "requests": 1, "blocks": 2}


def test_a_block_shared_at_one_position_only_counts_per_position():
    """A request that found only the first block cached holds a copy of the rest: 2 copies of the prompt."""
    holds = [(0.0, 5.0, 0, [1, 2, 3], 0), (1.0, 2.0, 0, [1, 7, 8], 1)]
    assert copies_over_time(holds)[0]["copies"] == [1, 2, 1, 0]
