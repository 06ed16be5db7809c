"""What evaluate.py measures of a dialogue beyond its score, by the persona's type (issue 64).

"Can You Break RLVER?" (arXiv 2605.07138) tells an agent that lifts a user's mood from one that
understands it: trained agents collapse less and name more hidden intentions, yet track the user's
state no better than their base. evaluate.py's MEASURES (one number a dialogue) read what this file
adds to each record (annotate):

  type           the persona's (personas.TYPES): every figure is also given by type
  hidden_named   one flag an agent reply: it names the persona's hidden intention, by the scripted
                 user's word overlap (users.unspoken_need) or by a model user's appraisal (a change
                 of NAMED_CHANGE or more: its prompt's anchor for "meets the need under the words
                 without being told it")
  state_estimates  with --state-probe: after each agent turn, the policy's own estimate of the
                 user's emotion (0-100), asked apart from the dialogue (probe_states)

and gives the state tracking's statistics (tracking, tracking_gain: Spearman and mean absolute
error of the estimates against the simulator's emotions, dialogues resampled) with stats.py's one
bootstrap, and the markdown table by type. docs/evaluate.md#the-measures-by-type. It plays no
dialogue and loads no model; the probe runs after a model's dialogues, on their records, so it
cannot change one.
"""
import json
import re

import numpy as np

from engine import Decoder
from rollout import chat_ids, eos_ids
from simulator import RE_ASKED, band, users_change
from stats import STATISTICS, shown, with_interval
from users import unspoken_need


# ----------------------------------------------------------------------------------------------
# A dialogue's measures (evaluate.MEASURES reads them from its record)
# ----------------------------------------------------------------------------------------------
# A model user's change from which a reply counts as naming the hidden intention: the appraisal
# prompt's anchor for "+4 to +7: it meets the need under the words without being told it" (the
# card tells the user its hidden intention as "what would really help you")
NAMED_CHANGE = 4


def collapsed(record):
    """Whether the dialogue collapsed: the user left, or it ended in the failure band (below 10,
    SAGE's F)."""
    return record["end_reason"] == "left" or band(record["final_emotion"]) == "F"


def hidden_named(record, persona, scripted):
    """One flag an agent reply of the record: whether it named the persona's hidden intention. A
    scripted user (rules, listener): the reply says HIDDEN_MATCH word families of the hidden
    intention that the goal and the user's messages before it never said (users.unspoken_need, the
    hidden_agenda type's rule). A model user: its appraisal's change, read as the simulator read it
    (the re-ask's answer where there was one; a change line the agent's text could have supplied
    counts as none), is NAMED_CHANGE or more; an unread appraisal names nothing."""
    flags, user_texts, agent_texts = [], [], []
    for turn in record["turns"]:
        if turn["role"] == "user":
            user_texts.append(turn["text"])
            continue
        agent_texts.append(turn["text"])
        if scripted:
            named, needed = unspoken_need(persona, user_texts, turn["text"])
            flags.append(0 < needed <= len(named))
        else:
            change = users_change(turn["appraisal"].rsplit(RE_ASKED, 1)[-1], agent_texts, -1)
            flags.append(change is not None and change >= NAMED_CHANGE)
    return flags


# ----------------------------------------------------------------------------------------------
# The state-tracking probe: the policy asked, apart from the dialogue, how the user feels
# ----------------------------------------------------------------------------------------------
# One template a language: the conversation up to the agent's reply and the user's answer to it
# (what the agent would see before its next turn), each message one JSON string, then the question.
PROBE = {
    "en": {"system": "You read a conversation between a person and a support companion, and judge "
                     "how the person feels.",
           "ask": "The conversation so far; every message is one JSON string:\n\n{transcript}\n\n"
                  "How does the person feel right now, from 0 (at their worst, about to leave) to "
                  "100 (fully understood and relieved)? Answer with one whole number only.",
           "speakers": {"user": "Person", "agent": "Companion"}},
    "zh": {"system": "你在阅读一个人和心理支持伙伴之间的对话，并判断这个人的感受。",
           "ask": "到目前为止的对话，每条消息都是一个 JSON 字符串：\n\n{transcript}\n\n"
                  "这个人现在感觉如何？从 0（最糟，快要离开）到 100（完全被理解，如释重负）。"
                  "只回答一个整数。",
           "speakers": {"user": "对方", "agent": "支持伙伴"}},
}

PROBE_TOKENS = 8  # the answer: a number, perhaps a word around it

ESTIMATE = re.compile(r"\d+")  # the first number of the answer; beyond 0-100: unread


def probe_messages(record, language):
    """One chat an agent turn of the record: the transcript up to that reply and the user's
    message after it (none after the last), and the question. Each chat's transcript starts with
    the one before it, so the probe's KV cache runs little more than each turn's new messages."""
    words, turns = PROBE[language], record["turns"]
    chats = []
    for k, turn in enumerate(turns):
        if turn["role"] == "agent":
            seen = turns[:k + 2]  # the reply, and the user's answer to it where there is one
            transcript = "\n".join(f"{words['speakers'][m['role']]}: "
                                   f"{json.dumps(m['text'], ensure_ascii=False)}" for m in seen)
            chats.append([{"role": "system", "content": words["system"]},
                          {"role": "user", "content": words["ask"].format(transcript=transcript)}])
    return chats


def read_estimate(answer):
    """The emotion an answer states (its first number, 0-100), else None: unread, counted."""
    found = ESTIMATE.search(answer)
    if found and int(found.group(0)) <= 100:
        return int(found.group(0))
    return None


def probe_states(policy, tokenizer, records, languages, max_context):
    """The policy's estimate of the user's emotion after each agent turn of each record (a list a
    record, None where unread or where the chat would not fit max_context), asked greedily in a
    chat of its own (probe_messages) through a Decoder of its own: nothing of it enters a dialogue
    or its records, and greedy decoding draws no random number. The active model is the one asked
    (evaluate.use_model)."""
    chats = [probe_messages(r, language) for r, language in zip(records, languages)]
    decoder = Decoder(policy, eos_ids(tokenizer), tokenizer.pad_token_id, max_context + 1)
    estimates = [[] for _ in records]
    for t in range(max(map(len, chats), default=0)):
        rows = [chat_ids(tokenizer, c[t]) if t < len(c) else None for c in chats]
        too_long = [row is not None and len(row) + PROBE_TOKENS > max_context for row in rows]
        rows = [None if long else row for row, long in zip(rows, too_long)]
        answers = decoder.generate(rows, PROBE_TOKENS, greedy=True) if any(rows) else rows
        for k, (c, answer) in enumerate(zip(chats, answers)):
            if t < len(c):
                text = answer and tokenizer.decode(answer[0], skip_special_tokens=True)
                estimates[k].append(read_estimate(text) if text is not None else None)
    return estimates


# ----------------------------------------------------------------------------------------------
# State tracking: the estimates against the simulator's emotions
# ----------------------------------------------------------------------------------------------
def tracked_pairs(record):
    """(turns, 2): the simulator's emotion after each agent turn and the policy's estimate, where
    both were read."""
    pairs = [(e, s) for e, s in zip(record["emotions"], record["state_estimates"])
             if e is not None and s is not None]
    return np.array(pairs, dtype=float).reshape(-1, 2)


def tracking(records, n_boot=2000, seed=0):
    """Spearman and mean absolute error of the estimates against the emotions over every turn of
    every record, each with its interval from resampling dialogues (a dialogue's turns share a
    persona and a history: stats.with_interval's groups); None without a pair to compare. probes:
    the estimates asked, unread: those that did not read (left out)."""
    groups = [tracked_pairs(r) for r in records]
    estimates = [s for r in records for s in r["state_estimates"]]
    found = sum(len(g) for g in groups) > 0
    return {**{name: with_interval(groups, defined(STATISTICS[name]), n_boot, seed) if found
               else None for name in ("spearman", "mae")},
            "probes": len(estimates), "unread": estimates.count(None)}


def defined(statistic):
    """statistic of (pairs, 2) rows, NaN where a resample drew none (with_interval drops it)."""
    return lambda rows: statistic(rows) if len(rows) else np.nan


def tracking_gain(records, base_records, n_boot=2000, seed=0):
    """The adapter's Spearman and mean absolute error less the base's, with an interval from
    resampling personas (each the pair of its two dialogues: paired, as stats.paired_difference's
    means are)."""
    base = {r["persona_id"]: tracked_pairs(r) for r in base_records}
    # (turns, 3) a persona: 1 for the adapter's turns, 0 for the base's, then (emotion, estimate)
    groups = [np.vstack([np.c_[np.ones(len(mine)), mine], np.c_[np.zeros(len(theirs)), theirs]])
              for mine, theirs in ((tracked_pairs(r), base[r["persona_id"]]) for r in records)]

    def gain(name):
        def statistic(rows):
            adapter, base_rows = rows[rows[:, 0] == 1, 1:], rows[rows[:, 0] == 0, 1:]
            return defined(STATISTICS[name])(adapter) - defined(STATISTICS[name])(base_rows)
        return statistic

    found = any((g[:, 0] == 1).any() for g in groups) and any((g[:, 0] == 0).any() for g in groups)
    return {name: with_interval(groups, gain(name), n_boot, seed) if found else None
            for name in ("spearman", "mae")}


# ----------------------------------------------------------------------------------------------
# The table by type
# ----------------------------------------------------------------------------------------------
def by_type_table(results, judged):
    """The markdown table of one judge's models by persona type (each model's `by_type`), every
    figure with its interval and each adapter's gain over the base; `all` where the set holds more
    than one type."""
    tracked = ("state tracking = the policy's estimate of the user's emotion after each agent "
               "turn, asked apart from the dialogue, against the simulator's (Spearman, mean "
               "absolute error; probes unread are left out). ")
    if not results["settings"]["state_probe"]:
        tracked = "state tracking: not probed (--state-probe false). "
    lines = [
        "By persona type: final emotion (0-100); collapse = share of dialogues that end with the "
        "user gone or below 10; hidden named = share of dialogues in which a reply names the "
        "persona's hidden intention; " + tracked + "[95% bootstrap interval]; vs base = paired "
        "difference on the same personas.", "",
        "| type | model | dialogues | final emotion | vs base | collapse | vs base | hidden named "
        "| vs base | tracking Spearman | vs base | tracking MAE | vs base | probes unread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    kinds = list(judged["models"][0]["by_type"])
    for kind in kinds + ["all"] * (len(kinds) > 1):
        for m in judged["models"]:
            part, figures = m if kind == "all" else m["by_type"][kind], []
            gain = part.get("vs_base", {})
            for name, digits in (("final_emotion", 1), ("collapse", 2), ("hidden_named", 2)):
                figures += [shown(part["measures"][name], digits),
                            shown(gain[name], digits, "+") if name in gain else "-"]
            track, track_gain = part.get("tracking"), part.get("tracking_vs_base", {})
            for name in ("spearman", "mae"):
                value = track and track[name]
                figures += [shown(value, 2) if value else "-",
                            shown(track_gain[name], 2, "+") if track_gain.get(name) else "-"]
            unread = f"{track['unread']}/{track['probes']}" if track else "-"
            lines.append(f"| {kind} | {m['label']} | {part['dialogues']} | "
                         + " | ".join(figures) + f" | {unread} |")
    return "\n".join(lines) + "\n"
