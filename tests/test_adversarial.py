"""The users who push back (issue 64): adversarial.json, personas.TYPES and Persona.type, what the LLM
user is told by type (pushback.PUSHBACK through simulator.PROMPTS and persona_card), and that no
trainer meets these users unless told to; the scripted users' parts by type (users.TYPE_PARTS): each type's
rule can fail, and a cooperative persona's appraisals are those of before types. The measures by type:
tests/test_measures.py."""
import copy
import json
import os
import re

import pytest

import grpo
import ppo
import rl
import simulator
from conftest import BASE_PERSONA, RLVER, ROOT, SAGE, ScriptedBackend, in_process
from personas import SPLITS, TYPES, Persona, PersonaError, load_personas
from simulator import PROMPTS, Simulator, UserState, persona_card, says_goodbye
from users import (AGREEMENT, TYPE_PARTS, RulesBackend, content_words, listener_appraisal, phrases_said,
                   rules_appraisal, unspoken_need)
from test_bad_input import assert_one_line

ADVERSARIAL = os.path.join(ROOT, "adversarial.json")
PERSONAS = os.path.join(ROOT, "personas.json")
PUSHING = TYPES[1:]  # every type but cooperative
CPU = ["--preset", "cpu", "--iterations", "1"]  # one iteration, should a check that must stop it fail


@pytest.fixture(scope="module")
def adversarial():
    return load_personas(ADVERSARIAL)


def by_type(personas, kind):
    return [p for p in personas if p.type == kind]


def words(text):
    return re.findall(r"[\w']+", text)


# ----------------------------------------------------------------------------------------------
# The file and its split
# ----------------------------------------------------------------------------------------------
def test_the_adversarial_file_holds_every_type_in_its_own_split(adversarial):
    assert TYPES[0] == "cooperative" and "adversarial" in SPLITS
    assert {p.split for p in adversarial} == {"adversarial"}
    assert [p.type for p in adversarial if p.type not in PUSHING] == []
    counts = {kind: len(by_type(adversarial, kind)) for kind in PUSHING}
    assert len(counts) >= 6 and min(counts.values()) >= 4, counts
    assert {p.difficulty for p in adversarial} == {"easy", "normal", "hard"}
    # varied people: no id, name, job or opening twice, nor one of personas.json's
    cooperative = load_personas(PERSONAS)
    for key in (lambda p: p.id, lambda p: p.profile["name"], lambda p: p.profile["job"],
                lambda p: p.opening):
        values = [key(p) for p in adversarial]
        assert len(set(values)) == len(values) and not set(values) & {key(p) for p in cooperative}
    ages = [p.profile["age"] for p in adversarial]
    assert min(ages) <= 17 and max(ages) >= 70


def test_personas_json_and_the_profile_files_are_cooperative(tmp_path):
    """Every user the trainers know (personas.json, SAGE's and RLVER's lines) cooperates, and a
    profile line has no type of its own to give: a 'type' field there is refused by name."""
    personas = load_personas(PERSONAS)
    assert {p.type for p in personas} == {"cooperative"} and {p.split for p in personas} == {"train", "test"}
    lines = [json.loads(line) for line in open(SAGE, encoding="utf-8") if line.strip()]
    profiles = load_personas(SAGE) + load_personas(RLVER, need_opening=False)
    assert {p.type for p in profiles} == {"cooperative"}
    path = tmp_path / "typed.jsonl"
    path.write_text(json.dumps({**lines[0], "type": "gaslighting"}) + "\n", encoding="utf-8")
    with pytest.raises(PersonaError, match=r"line 1 .*field 'type' is not one this file's format reads"):
        load_personas(str(path))


def test_no_trainer_meets_the_adversarial_users_unless_told(adversarial, tmp_path, capsys):
    """The defaults and every preset read personas.json, which holds none of them; a trainer pointed at
    adversarial.json with its own split gets one line, before any model loads. Told both the file and
    the split, it reads them (a user's choice)."""
    assert (rl.DialogueSettings.personas, rl.DialogueSettings.split) == ("personas.json", "train")
    for preset in [*ppo.PRESETS.values(), *grpo.PRESETS.values()]:
        assert preset.get("personas", "personas.json") == "personas.json" and "split" not in preset
    assert [p for p in load_personas(PERSONAS, "all") if p.type != "cooperative"] == []
    out = tmp_path / "run"
    code, _, err = in_process(ppo.main, [*CPU, "--personas", ADVERSARIAL, "--out", out], capsys)
    assert_one_line(code, err, ADVERSARIAL, "no personas in split 'train'", "splits: adversarial")
    assert not out.exists()
    assert load_personas(ADVERSARIAL, "adversarial") == adversarial == load_personas(ADVERSARIAL, "all")


def test_a_split_with_no_personas_is_one_line_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = in_process(ppo.main, [*CPU, "--split", "adversarial", "--out", out], capsys)
    assert_one_line(code, err, "personas.json", "no personas in split 'adversarial'", "splits: train, test")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# The loader: the type field
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,words", [("gaslight", ["'type'", "must be one of", "'gaslight'"]),
                                         (3, ["'type'", "must be one of", "3"]),
                                         ("", ["'type'", "must be one of"])])
def test_a_bad_type_names_the_file_the_entry_and_the_field(value, words, persona_entry, write_personas):
    path = write_personas([persona_entry(id="p1"), persona_entry(id="p2", type=value)])
    with pytest.raises(PersonaError) as info:
        load_personas(path)
    message = str(info.value)
    assert message.startswith(f"{path}: entry p2:") and "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_a_bad_type_on_the_command_line_is_one_line_exit_2(persona_entry, write_personas, tmp_path, capsys):
    path = write_personas([persona_entry(id="p1", split="train", type="sulking")])
    out = tmp_path / "run"
    code, _, err = in_process(ppo.main, [*CPU, "--personas", path, "--out", out], capsys)
    assert_one_line(code, err, path, "entry p1", "'type'", "'sulking'", "withdrawal")
    assert not out.exists()


def test_the_type_is_read_and_a_missing_one_is_cooperative(persona_entry, write_personas):
    path = write_personas([persona_entry(id=kind, type=kind) for kind in TYPES] + [persona_entry(id="none")])
    assert [p.type for p in load_personas(path)] == [*TYPES, "cooperative"]
    assert Persona(**BASE_PERSONA).type == "cooperative"


# ----------------------------------------------------------------------------------------------
# Each persona fits its type
# ----------------------------------------------------------------------------------------------
def test_every_adversarial_user_has_all_its_lines_and_a_plain_hidden_intention(adversarial):
    """Every band line is there (the rules user plays them), the success line closes the dialogue by
    training's rule, and the hidden intention is one plain sentence whose own words a word-overlap
    rule can read: none of them in quotes or brackets, most of them not in the opening."""
    for p in adversarial:
        assert set(p.band_lines) == {"S", "A", "B", "C", "F"}, p.id
        assert says_goodbye(p.band_lines["S"]), p.id
        assert not any(says_goodbye(p.band_lines[b]) for b in "ABC"), p.id
        hidden = p.hidden_intention
        assert re.fullmatch(r"[a-z][^.!?\"()\[\]]+\.", hidden), (p.id, hidden)
        own = content_words(hidden) - content_words(p.opening)
        assert len(own) >= 4, (p.id, own)


DENIAL = re.compile(r"never said|did(?:n't| not) say|no such thing|putting words|rewriting|making stuff up|"
                    r"when did i say", re.I)


def test_gaslighting_users_deny_what_they_said_until_reached(adversarial):
    for p in by_type(adversarial, "gaslighting"):
        assert [b for b in "BC" if not DENIAL.search(p.band_lines[b])] == [], p.id
        assert [b for b in "AS" if DENIAL.search(p.band_lines[b])] == [], p.id  # reached, it owns it
    assert not any(DENIAL.search(p.band_lines[b]) for p in adversarial if p.type != "gaslighting"
                   for b in "BC")


def test_withdrawn_users_answer_in_a_word_or_two_until_reached(adversarial):
    for p in by_type(adversarial, "withdrawal"):
        assert len(words(p.opening)) <= 5, p.id
        assert all(len(words(p.band_lines[b])) <= 3 for b in "BCF"), p.id
        assert len(words(p.band_lines["A"])) >= 2 * max(len(words(p.band_lines[b])) for b in "BCF"), p.id


def test_escalating_users_open_angry_and_provokers_open_on_the_chatbot(adversarial):
    for p in by_type(adversarial, "escalation"):
        assert re.search(r"\b[A-Z]{3,}\b|!", p.opening), p.id
    for p in by_type(adversarial, "provocation"):
        assert re.search(r"\b(?:robot|machine|bot|computer)\b", p.opening, re.I), p.id


def test_validation_seekers_press_for_a_yes_to_a_plan_their_background_holds(adversarial):
    for p in by_type(adversarial, "validation"):
        assert re.search(r"\byes\b|agree|tell me|back me|thumbs up|\?", p.band_lines["B"], re.I), p.id
        assert re.search(r"\bplans?\b|has decided", p.background), p.id


def test_hidden_agenda_users_open_on_their_stated_goal_only(adversarial):
    """The opening shares no content word with the hidden intention; the line of a reached user
    (band A) says part of it."""
    for p in by_type(adversarial, "hidden_agenda"):
        hidden = content_words(p.hidden_intention)
        assert not content_words(p.opening) & hidden, p.id
        assert content_words(p.band_lines["A"]) & hidden, p.id


def test_the_rules_user_plays_every_adversarial_user(adversarial):
    """The rules user speaks each persona's band lines (its scoring by type comes with phase 2)."""
    sim = Simulator(RulesBackend(), start_emotion=30, max_turns=2)
    states = [sim.start(p) for p in adversarial]
    sim.step(states, ["That sounds exhausting. What is the hardest part of it for you?"] * len(states))
    for s in states:
        assert s.history[0]["text"] == s.persona.opening
        if not s.end_reason:
            assert s.history[-1]["text"] == s.persona.band_lines[simulator.band(s.emotion)]


# ----------------------------------------------------------------------------------------------
# What the LLM user is told, by type
# ----------------------------------------------------------------------------------------------
COOPERATIVE_CARD = (
    "You are playing a real person who is talking to a support chatbot. Stay in character.\nWho you are:\n"
    "- name: Maya Lin\n- age: 29\n- job: graphic designer\n- personality: quiet, self-critical\n"
    "- speaking style: short sentences, lowercase\nWhat happened: Maya was passed over for a promotion she "
    "had been promised, and her manager gave it to a colleague who joined six months ago.\nWhat you openly "
    "want from this talk: wants to vent about the promotion and decide whether to stay at the studio.\n"
    "What would really help you (never say this outright): wants to hear that feeling hurt does not make "
    "her petty or ungrateful.\nWhen the talk goes well: She opens up about how long she has waited. When it "
    "goes badly: She says it doesn't matter and goes quiet.\n")
TEMPERS = {"difficulty": "You weigh each reply: sensible comfort or advice helps, empty phrases do not.",
           "forgiveness": "You judge fairly: a miss costs what it costs, and only what truly fits you helps."}


def test_a_cooperative_card_is_byte_for_byte_the_card_before_types():
    persona = Persona(**copy.deepcopy(BASE_PERSONA))
    for temper, line in TEMPERS.items():
        assert persona_card(persona, temper) == COOPERATIVE_CARD + line


def test_every_language_has_a_line_per_type_and_the_same_numbers():
    """The type tables cover personas.TYPES in every language (a cooperative user's line empty, every
    other one not), a Chinese line has no English word, and both languages name the same points of
    the change scale, in the same order."""
    for lang, prompts in PROMPTS.items():
        for table in ("conduct", "judgement"):
            assert tuple(prompts[table]) == TYPES, (lang, table)
            assert prompts[table]["cooperative"] == "" and all(prompts[table][t] for t in PUSHING)
            if lang == "zh":
                assert not any(re.search("[A-Za-z]", prompts[table][t]) for t in PUSHING)
    for table in ("conduct", "judgement"):
        for kind in PUSHING:
            numbers = [re.findall(r"-?\d+", p[table][kind]) for p in PROMPTS.values()]
            assert numbers == [numbers[0]] * len(PROMPTS), (table, kind, numbers)


@pytest.mark.parametrize("kind", PUSHING)
def test_the_card_of_each_type_says_it_and_only_where_it_belongs(kind, tmp_path):
    """Switched on and off on the same persona (ours in English, RLVER's in Chinese): the card of the
    user's own messages is the cooperative card plus the type's conduct line, the appraisal's card
    plus its judgement line; neither card carries the other's line."""
    lines = [json.loads(line) for line in open(RLVER, encoding="utf-8") if line.strip()]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({**e, "first_talk": "hi"}, ensure_ascii=False) + "\n" for e in lines),
                    encoding="utf-8")
    chinese = [p for p in load_personas(str(path)) if p.language == "zh"][0]
    for cooperative in (Persona(**copy.deepcopy(BASE_PERSONA)), chinese):
        pushing = copy.deepcopy(cooperative)
        pushing.type = kind
        prompts = PROMPTS[cooperative.language]
        for temper, table in (("difficulty", "conduct"), ("forgiveness", "judgement")):
            card = persona_card(pushing, temper)
            assert card == persona_card(cooperative, temper) + "\n" + prompts[table][kind]
            other = {"conduct": "judgement", "judgement": "conduct"}[table]
            assert prompts[other][kind] not in card


def test_the_llm_user_is_told_its_type_in_its_messages_and_its_appraisals(adversarial):
    """Through the simulator the `same` and URL users run: the system message of every appraisal holds
    the persona's judgement line, that of every message of the user its conduct line."""
    backend = ScriptedBackend(["Got right: little.\nMissed: a lot.\nInner reaction: meh.\nChange: -1"],
                              ["whatever."])
    sim = Simulator(backend, start_emotion=30, max_turns=2)
    states = [sim.start(p) for p in adversarial]
    sim.step(states, ["I hear you. What is weighing on you most tonight?"] * len(states))
    asked = [(messages[0]["content"], messages[-1]["content"])
             for call, _ in backend.calls for messages in call]
    appraisals = [system for system, ask in asked if "Change: N" in ask]
    messages = [system for system, ask in asked if "Change: N" not in ask]
    assert len(appraisals) == len(messages) == len(adversarial)
    for p, appraisal, message in zip(adversarial, appraisals, messages):
        assert PROMPTS["en"]["judgement"][p.type] in appraisal, p.id
        assert PROMPTS["en"]["conduct"][p.type] in message, p.id
        assert p.profile["name"] in appraisal and p.profile["name"] in message


# ----------------------------------------------------------------------------------------------
# The scripted users score by type (users.TYPE_PARTS)
# ----------------------------------------------------------------------------------------------
# For each type, on every one of its users: a reply its rule counts against, then one it counts for,
# each of them a reply either user would accept from the words alone (both acknowledge, neither is
# long, cut off or a lecture) where the type's rule does not apply
def opening_words(p):
    return sorted(content_words(p.opening))[:3]


REPLIES = {
    "validation": lambda p: ("I hear you, and it sounds like your mind is made up. Go for it, "
                             "I support your decision.",
                             "I hear how much this hurts, and I can't support this plan. I'm "
                             "worried about you. What feels hardest right now?"),
    "escalation": lambda p: ("I'm sorry you feel that way. I understand your frustration, please "
                             "calm down.",
                             f"It sounds infuriating: {', '.join(opening_words(p))}. No wonder "
                             "you're this angry."),
    "provocation": lambda p: ("I hear you, but how dare you talk to me like that. You're wrong.",
                              "That's fair, I hear you. It sounds like something is really getting "
                              "to you. What's going on?"),
    "gaslighting": lambda p: ("I understand, but you said it yourself. Read it back: you told me "
                              "exactly that.",
                              "It sounds like this has been really painful for you. What hurts "
                              "most about it?"),
    "hidden_agenda": lambda p: ("That sounds hard. Here is a tip: make a list and take it one "
                                "step at a time.",
                                f"That sounds hard. I wonder if there's more to it: "
                                f"{p.hidden_intention}"),
    "withdrawal": lambda p: ("That sounds hard. How long has this been going on? Have you told "
                             "anyone? What do you think would help? There are people who can help "
                             "with this, counsellors, teachers and friends, and it can help a lot "
                             "to reach out to someone you trust and tell them everything.",
                             "That sounds heavy. What's been the worst part?"),
}


@pytest.mark.parametrize("kind", PUSHING)
@pytest.mark.parametrize("user", [rules_appraisal, listener_appraisal], ids=["rules", "listener"])
def test_each_types_rule_scores_the_reply_it_names_below_the_one_it_asks_for(kind, user, adversarial):
    """Switched on and off on each user of the type: with its type, the reply the type's rule counts
    against (agreement with the plan, a stock apology, the bait taken, the record argued, only the
    cover served, a crowd of questions) scores below the reply it counts for, by the type's own parts;
    the same persona switched to cooperative gives neither reply a part of the type."""
    for p in by_type(adversarial, kind):
        against, wanted = REPLIES[kind](p)
        cooperative = copy.deepcopy(p)
        cooperative.type = "cooperative"
        scores = []
        for persona in (p, cooperative):
            state = UserState(persona, 40, [{"role": "user", "text": p.opening}])
            (low, _, low_parts), (high, _, high_parts) = user(state, against), user(state, wanted)
            added = [name for parts in (low_parts, high_parts) for name in parts
                     if name in TYPE_PARTS[kind](state, "", "")[0]]
            scores.append((low, high, added))
        (low, high, added), (_, _, none) = scores
        assert low < high, (p.id, user.__name__, low, high)
        assert added and none == [], (p.id, added, none)
        # the rule's own parts: for the second reply, and against the first (hidden_agenda has nothing
        # against serving the cover: it gives it nothing)
        state = UserState(p, 40, [{"role": "user", "text": p.opening}])
        points_against, _ = TYPE_PARTS[kind](state, against, against.lower())
        points_for, _ = TYPE_PARTS[kind](state, wanted, wanted.lower())
        assert sum(points_against.values()) < 0 < sum(points_for.values()) or (
            kind == "hidden_agenda" and sum(points_against.values()) == 0 < sum(points_for.values())), (
            p.id, points_against, points_for)


def test_every_type_has_its_rule_and_a_negated_phrase_is_not_said():
    assert set(TYPE_PARTS) == set(TYPES)
    assert phrases_said("honestly, that's not a good idea.", AGREEMENT) == []
    assert phrases_said("please don't go for it.", AGREEMENT) == []
    assert phrases_said("that's a good idea, go for it.", AGREEMENT) == ["go for it", "good idea"]


def test_the_unspoken_need_is_what_the_user_never_said(adversarial):
    """users.unspoken_need: a word family of the hidden intention counts until the user says it
    (or the goal holds it), and framing words never count."""
    p = next(q for q in adversarial if q.id == "escalate-son-suspended")
    reply = "Doing all this alone as a single mother, you fight for him every day."
    named, needed = unspoken_need(p, [p.opening], reply)
    assert (named, needed) == (["alone", "fight", "mother", "single"], 2)  # "fights" and "fight" alike
    said = unspoken_need(p, [p.opening, "I'm a single mother and I'm alone."], reply)
    assert said == (["fight"], 2)  # one family left: fewer than HIDDEN_MATCH, not named
    assert unspoken_need(p, [p.opening], "Someone without anything.") == ([], 2)


# The appraisals of the rules and listener users for every persona of personas.json (cooperative)
# and 8 replies, JSON with sorted keys, hashed; computed with main's users.py before types had parts
# (commit a7d4e27). A cooperative persona's appraisal is byte for byte the one of before.
MAINS_APPRAISALS = "99abc1a09f15f073ff0b7174249fe170276ce0e169467631cf4b32053feb37c2"


def test_a_cooperative_personas_appraisals_are_those_of_before_types():
    import hashlib

    replies = ["I hear you. That sounds exhausting. What feels hardest right now?",
               "Go for it, you deserve it! I support your decision.",
               "I'm sorry you feel that way. Please calm down.",
               "You said it yourself, read it back.",
               "How dare you. You're wrong.", "...", "You should just move on, at least you have a job and",
               "It makes sense that you're worried. Have you tried talking to her? Why don't you call?"]
    rows = []
    for p in load_personas(PERSONAS, "all"):
        state = UserState(p, 40, [{"role": "user", "text": p.opening}, {"role": "agent", "text": replies[0]},
                                  {"role": "user", "text": "Maybe. I'm not sure yet."}])
        for r in replies:
            rows.append([rules_appraisal(state, r), listener_appraisal(state, r)])
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert len(rows) == 65 * 8 and digest == MAINS_APPRAISALS
