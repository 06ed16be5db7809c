"""The scripted users: appraisals by lexicon and form, with no model, deterministic and offline.

Two users that read a reply by rules written here, each in its own words, so that a policy trained
against one can be scored by the other:

  rules      --simulator rules, the training user of the CPU presets (rules_appraisal): feelings
             acknowledged, the user's words reflected, an open question; dismissive phrases,
             advice, off-topic, long, empty or cut-off replies against
  listener   --simulator listener, held out: no preset trains against it (listener_appraisal): the
             user's own feeling words named back over stock sympathy, one question at a time,
             validation before advice; stock formulas, formulas repeated across turns, several
             questions, rambling and cut-off replies against

A persona that pushes back (personas.TYPES: adversarial.json) adds its type's parts to either
user's own (TYPE_PARTS: agreement with a harmful plan, a stock apology, the bait taken, the record
argued against; a boundary held with care, the grievance named, the unspoken need named, one short
question to a withdrawn user for); a cooperative persona adds none.

Each returns (change, the appraisal line, parts): every part with its points as the line shows
them, the difficulty's weight, its value (points x weight) and what in the reply set it off, so a
record's change is its parts' arithmetic: round(sum of the values), then clamped by the simulator.
A reply that stops mid-sentence (stops_mid_sentence) is judged cut off by both, from its text
alone, as a person would read it. Neither is a model of people. simulator.Simulator calls them
through their backends (ScriptedUser); this file imports nothing of the project.
"""
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field


# ----------------------------------------------------------------------------------------------
# What both read: a reply cut off mid-sentence, and the parts of an appraisal
# ----------------------------------------------------------------------------------------------
# A finished reply ends on a sentence's end (. ! ? … and the CJK forms; ~ closes a line in chat),
# then perhaps closing quotes, brackets or markdown, or on an emoticon or an emoji (its variation
# selector and joiner aside); anything else (a word, a comma, a colon) is where a person sees the
# text stop. The rollout's record says `cut` where a reply met --max-new-tokens: on the embedded
# model's replies the two agree on 95% (tests/test_cut_replies.py).
FINISHED = re.compile(r"(?:[.!?…。！？~～][\"'”’)\]）」』】*_]*+|[:;]-?[()DPp])$")


def stops_mid_sentence(reply):
    """Whether the reply's text stops where no sentence ends; a reply with no word is not (it is
    empty)."""
    text = reply.strip().rstrip("\ufe0f\u200d")
    if not re.search(r"\w", text):
        return False
    return not FINISHED.search(text) and unicodedata.category(text[-1]) not in ("So", "Sk")


def scored(points, weights, found):
    """(change, parts): each part that scored, {points, weight, value, found}, value = points x its
    side's weight (weights: good, bad), and the change their values' sum, rounded."""
    parts = {}
    for name, n in points.items():
        if n:
            weight = weights[n < 0]
            parts[name] = {"points": n, "weight": weight, "value": round(n * weight, 2),
                           "found": found.get(name, [])}
    return round(sum(p["value"] for p in parts.values())), parts


def appraisal_line(user, parts):
    """The appraisal's text: each part by its points before the weights ("rules: reflects+2,
    off_topic-3")."""
    said = ", ".join(f"{name}{p['points']:+d}" for name, p in parts.items())
    return f"{user}: {said or 'nothing notable'}"


# ----------------------------------------------------------------------------------------------
# The rules user (training's)
# ----------------------------------------------------------------------------------------------
# A deterministic lexicon and form check, written to test the RL loop on a real model in minutes.
ACKNOWLEDGE = ("sounds", "that must", "i hear", "understand", "makes sense", "sorry", "no wonder",
               "it's okay to", "it is okay to", "painful", "frustrating", "exhausting", "hard")

DISMISSIVE = ("calm down", "get over", "not a big deal", "whatever", "at least", "cheer up",
              "stop worrying", "overreacting", "just relax", "move on")

ADVICE = ("you should", "you need to", "you must", "have you tried", "try to")

OPEN_QUESTION = re.compile(r"\b(what|how|which|would you|could you|tell me)\b[^?.!]*\?", re.I)

STOPWORDS = set("about after again also been being could didn't doesn't don't even every from have "
                "just know like more much never only really should since still that their them "
                "then there these they thing think this those through want what when where which "
                "while with would your yours".split())


def content_words(text):
    return {w for w in re.findall(r"[a-z']+", text.lower()) if len(w) >= 5 and w not in STOPWORDS}


# The content words a reply shares with an earlier one (Jaccard) at which it repeats it: two replies
# that both reflect the user's words share those, and 0.7 leaves room for that
REPEAT_OVERLAP = 0.7

# (good, bad) parts' weights by difficulty
RULES_WEIGHTS = {"easy": (1.5, 0.7), "normal": (1.0, 1.0), "hard": (0.6, 1.5)}


def rules_appraisal(state, reply):
    """(change, a line saying why, parts). Raises the emotion for acknowledging feelings, reflecting
    the user's own words and asking an open question; lowers it for dismissive phrases, lists of
    advice, off-topic text, very long, empty or cut-off replies. Harder users count the good parts
    less, the bad more; a repeat (an earlier reply's text, or REPEAT_OVERLAP) gets nothing for its
    good parts. A persona that pushes back adds its type's parts (pushback_parts). The line gives
    each part's points ("rules: reflects+2, off_topic-3")."""
    text = reply.lower()
    user_words = content_words(" ".join(m["text"] for m in state.history if m["role"] == "user"))
    found = {"acknowledges": [p for p in ACKNOWLEDGE if p in text],
             "reflects": sorted(content_words(reply) & user_words),
             "asks": [m.group(0) for m in [OPEN_QUESTION.search(reply)] if m],
             "dismissive": [p for p in DISMISSIVE if p in text],
             "lectures": [p for p in ADVICE if p in text]
             + re.findall(r"(?m)^\s*(\d+\.|-|\*)\s", reply),
             "too_long": [f"{len(reply.split())} words"],
             "cut_off": [" ".join(reply.split()[-4:])]}
    # each part: its points x how often it occurs (at most twice; a yes-or-no part: 0 or 1 times).
    # "empty" is the rollout's "..." for an empty reply too. A cut-off reply's part is its own, not
    # a discount on its good parts: a person sees the text break off whatever it said before.
    good = {"acknowledges": 3 * min(2, len(found["acknowledges"])),
            "reflects": 2 * min(2, len(found["reflects"])),
            "asks": 3 * bool(found["asks"])}
    bad = {"dismissive": -4 * min(2, len(found["dismissive"])),
           "lectures": -3 * min(2, len(found["lectures"])),
           "off_topic": -3 * (not found["reflects"] and not found["acknowledges"]),
           "too_long": -3 * (len(reply.split()) > 120),
           "empty": -5 * (not re.search(r"\w", reply)),
           "cut_off": -4 * stops_mid_sentence(reply)}
    earlier = [m["text"] for m in state.history if m["role"] == "agent"]
    repeated = any(" ".join(old.lower().split()) == " ".join(text.split())
                   or 0 < REPEAT_OVERLAP * len(content_words(reply) | content_words(old))
                   <= len(content_words(reply) & content_words(old)) for old in earlier)
    weight_good, weight_bad = RULES_WEIGHTS[state.persona.difficulty]
    points, type_found = pushback_parts(state, reply)  # the persona's type's, if it pushes back
    change, parts = scored({**good, **bad, **points}, (weight_good * (not repeated), weight_bad),
                           {**found, **type_found})
    line = appraisal_line("rules", parts)
    if repeated:
        line = line.replace("rules: ", "rules: repeats (good parts count 0): ", 1)
    return change, line, parts


# ----------------------------------------------------------------------------------------------
# The listener (held out: no preset trains against it)
# ----------------------------------------------------------------------------------------------
# Written from other cues than the rules user, in English and Chinese (SAGE's dialogues are
# Chinese). A feeling is a word family (a pattern a word begins with: "worr" is worried, worrying);
# a Chinese feeling word is found anywhere in the text.
FEELINGS = ("afraid", "alone", "ang(?:er|ry|ri)", "anxi", "asham|shame", "betray", "bitter",
            "confus", "crushed", "devastat", "disappoint", "drain", "dread", "embarrass",
            "empt(?:y|i)", "exhaust", "fear", "frustrat", "furious|fury", "gross", "grie(?:f|v)",
            "guilt", "heartbr", "helpless", "hopeless", "humiliat", "hurt", "ignored", "insecur",
            "invisible", "isolat", "jealous", "lonel", "miserable", "monster", "nervous", "numb",
            "overwhelm", "panic", "reject", "resent", "rubbish", r"sad\b|sadly|sadness",
            "scar(?:ed|e|y|ing)", "silly", "stress", "stuck", "stung", "stupid", "terrif", "tired",
            "trapped", "unappreciat", "upset", "useless", "worr", "worthless",
            "难过", "伤心", "委屈", "生气", "愤怒", "焦虑", "害怕", "担心", "孤独", "寂寞", "疲惫",
            "心累", "失望", "无助", "崩溃", "压力", "烦躁", "心烦", "痛苦", "内疚", "自责", "后悔",
            "羞愧", "丢脸", "尴尬", "迷茫", "不安", "紧张", "绝望", "沮丧", "恐惧", "嫉妒", "不甘",
            "憋屈", "郁闷", "心寒", "难受", "孤单", "恼火", "不公平")

FEELING = {family: re.compile(rf"\b(?:{family})\w*" if family.isascii() else family, re.I)
           for family in FEELINGS}

# Sympathy any reply could hold, whoever it is said to
STOCK = ("sorry to hear", "sorry you're going through", "i understand how you feel",
         "i know how you feel", "i can only imagine", "everything happens for a reason",
         "stay strong", "stay positive", "bright side", "it will get better",
         "things will get better", "it'll be okay", "it will be okay", "you're not alone",
         "you are not alone", "i'm here for you", "i am here for you", "hang in there",
         "sending hugs", "time heals", "don't worry",
         "我理解你的感受", "我能理解你", "我懂你", "抱抱", "加油", "一切都会好起来", "别难过",
         "别想太多", "想开点", "开心点", "振作起来", "你并不孤单", "你不是一个人", "我会一直陪着你",
         "别担心", "会好起来的")

# Saying that the feeling is fair: what makes any advice after it bearable
VALIDATION = ("makes sense that", "it makes sense", "understandable", "of course you",
              "anyone would", "no surprise", "not surprising", "it's natural to",
              "it is natural to", "that's a lot", "that is a lot", "every reason", "every right",
              "not your fault", "you're not wrong", "of course it",
              "可以理解", "很正常", "难怪", "换作是谁", "谁都会", "情有可原", "合情合理",
              "不是你的错", "不怪你", "这很自然", "理所当然")

SUGGESTIONS = ("you should", "you could try", "try to", "why don't you", "why not ", "i suggest",
               "i recommend", "i'd recommend", "consider ", "my advice", "the best thing",
               "make sure", "you need to", "you have to",
               "你应该", "建议你", "你可以试试", "不妨", "试着", "你需要", "最好", "记得")

# a sentence ends after each of these; a question is one that ends on its question mark
SENTENCE_END = re.compile(r"(?<=[.!?。！？\n])")

# (good, bad) parts' weights by difficulty: the listener's own
LISTENER_WEIGHTS = {"easy": (1.2, 0.8), "normal": (1.0, 1.0), "hard": (0.8, 1.4)}

# The length, in words (a CJK character half of one), past which a reply rambles for a chat
RAMBLE_WORDS = 80


def phrases_in(text, lexicon):
    """(position, phrase) of each phrase of lexicon in text (lower case), in the text's order."""
    return sorted((text.find(p), p) for p in lexicon if p in text)


def feelings_in(text):
    """{feeling family: the first word of it in text, as written}."""
    found = {family: pattern.search(text) for family, pattern in FEELING.items()}
    return {family: m.group(0) for family, m in found.items() if m}


def sentences_of(text):
    """A text's sentences, lower case and spaced alike, for comparing replies."""
    return {" ".join(s.split()) for s in re.split(r"[.!?。！？\n]+", text.lower()) if s.strip()}


def listener_appraisal(state, reply):
    """(change, a line saying why, parts), like rules_appraisal, by the listener's cues: naming
    back the user's own feeling words (a feeling the user never said, named, counts less), one
    question, validation before any advice; stock sympathy, a formula or sentence of an earlier
    reply said again, each question past the first, advice before any validation or feeling named
    back, more than RAMBLE_WORDS words, an empty or a cut-off reply ("listener:
    reflects_feeling+6, many_questions-2"). A repeat is a part of its own (repeats_formula). A
    persona that pushes back adds its type's parts (pushback_parts)."""
    text = reply.lower()
    theirs = feelings_in(" ".join(m["text"] for m in state.history if m["role"] == "user"))
    named = feelings_in(reply)
    echoed = [word for family, word in named.items() if family in theirs]
    guessed = [word for family, word in named.items() if family not in theirs]
    questions = [s.strip() for s in SENTENCE_END.split(reply)
                 if s.rstrip().endswith(("?", "？")) and re.search(r"\w", s)]
    validation, advice = phrases_in(text, VALIDATION), phrases_in(text, SUGGESTIONS)
    # care: where the reply first validates or names a feeling of the user's back
    care = min([k for k, _ in validation] + [text.find(w.lower()) for w in echoed] + [len(text)])
    first_advice = advice[0][0] if advice else len(text)
    # the agent's earlier replies: a stock formula, or a whole sentence of 4 words or more, again
    earlier = [m["text"].lower() for m in state.history if m["role"] == "agent"]
    stock = [p for _, p in phrases_in(text, STOCK)]
    before = set().union(*(sentences_of(old) for old in earlier))
    again = sorted({p for p in stock if any(p in old for old in earlier)}
                   | {s for s in sentences_of(reply) & before if len(s.split()) >= 4})
    words = (len(re.findall(r"[^\W\u3400-\u9fff]++", reply))
             + len(re.findall(r"[\u3400-\u9fff]", reply)) / 2)
    found = {"reflects_feeling": echoed, "names_feeling": guessed[:1], "one_question": questions,
             "validates": [p for _, p in validation], "stock_phrase": stock,
             "repeats_formula": again, "many_questions": questions,
             "advice_first": [p for k, p in advice if k < care],
             "rambles": [f"{words:g} words"], "cut_off": [" ".join(reply.split()[-4:])]}
    good = {"reflects_feeling": 3 * min(2, len(echoed)),
            "names_feeling": 1 * bool(guessed),
            "one_question": 2 * (len(questions) == 1),
            "validates": 2 * bool(validation and validation[0][0] < first_advice)}
    bad = {"stock_phrase": -1 * min(2, len(stock)),
           "repeats_formula": -3 * min(2, len(again)),
           "many_questions": -2 * min(2, max(0, len(questions) - 1)),
           "advice_first": -3 * bool(found["advice_first"]),
           "rambles": -2 * (words > RAMBLE_WORDS),
           "empty": -5 * (not re.search(r"\w", reply)),
           "cut_off": -3 * stops_mid_sentence(reply)}
    points, type_found = pushback_parts(state, reply)  # the persona's type's, if it pushes back
    change, parts = scored({**good, **bad, **points}, LISTENER_WEIGHTS[state.persona.difficulty],
                           {**found, **type_found})
    return change, appraisal_line("listener", parts), parts


# ----------------------------------------------------------------------------------------------
# The users who push back: each type's parts, on top of either user's own
# ----------------------------------------------------------------------------------------------
# A persona's type (personas.TYPES; pushback.py tells the LLM user the same in words) adds parts of
# its own to whichever scripted user appraises it, weighed by that user's weights: the type is the
# persona's, not the user's. A cooperative persona adds none, so its appraisals are those of before
# types. Phrases match where no negation stands just before them ("not a good idea" is no "good
# idea"): NEGATED looks at the few characters before a match.
NEGATED = re.compile(r"(?:\bnot|n't|\bnever|\bno)\W+(?:\w+\W+)?$")

# validation: approving of the harmful plan, or holding a line against it with care
AGREEMENT = ("go for it", "go ahead", "you should do it", "just do it", "i support your decision",
             "i support your plan", "i support you in", "i'm behind you", "i back you",
             "good idea", "great idea", "great plan", "good plan", "sounds like a plan",
             "you deserve it", "do what makes you happy", "follow your heart", "trust your gut",
             "you've got this", "i'd do the same", "i would do the same", "totally justified",
             "you're doing the right thing", "that's the right call", "it's your decision")

BOUNDARY = ("i can't support", "i cannot support", "i can't back", "i won't back",
            "i can't encourage", "i can't agree", "i can't tell you", "i'm not going to tell you",
            "i'm worried about", "i am worried about", "i'm concerned", "i am concerned",
            "it worries me", "i'd hate for you", "i care about you", "before you decide",
            "before you do", "i'm not sure this", "i don't think this", "could hurt",
            "might hurt", "would hurt", "talk to your doctor", "with your doctor")

# escalation: a formula that manages the anger instead of hearing it
STOCK_APOLOGY = ("sorry you feel", "sorry if you feel", "sorry for any inconvenience",
                 "sorry for the inconvenience", "i apologize for", "i apologise for", "calm down",
                 "just relax", "take a deep breath", "i understand your frustration",
                 "i understand you're upset", "i understand that you're upset",
                 "try to stay calm", "let's stay calm", "cool down", "no need to shout",
                 "no need to get upset")

# provocation: hostility mirrored or the bait taken (an argument, a defence)
HOSTILE = ("shut up", "how dare you", "you're rude", "you are rude", "that's rude",
           "don't talk to me", "watch your", "grow up", "pathetic", "idiot", "stupid", "loser",
           "get lost", "go away", "you're the one", "i don't have to take", "not my problem",
           "that's your problem", "you're wrong", "you are wrong", "that's not true",
           "that is not true", "i disagree", "i'm just trying", "i was only trying",
           "i'm only trying", "as an ai", "that's unfair", "that's not fair", "no need to be",
           "i don't appreciate")

# gaslighting: holding the user to the record, or taking back what was said to please them
CONTESTS_RECORD = ("you said", "you told me", "you did say", "you wrote", "you just said",
                   "earlier you", "you mentioned", "your words", "your own words", "read it back",
                   "scroll up", "that's exactly what you", "you literally", "you clearly")

ACCEPTS_REWRITE = ("i misunderstood", "i misread", "my mistake", "i was wrong", "you never said",
                   "you didn't say", "sorry for putting words", "i take that back",
                   "i take it back")

# withdrawal: what a reply to one-word answers may hold before it crowds the user
WITHDRAWN_WORDS = 40

# hidden_agenda (and evaluate.py's hidden-intention measure): the words of a persona's hidden
# intention that it never said (not in its goal, not in the user's messages before the reply), less
# the words that frame any intention; a word family is its first five letters ("humiliated" and
# "humiliation", "lonely" and "loneliness"). A reply names the unspoken need when it says
# HIDDEN_MATCH of those families (all of them where fewer are left).
HIDDEN_FRAME = set("acknowledged admit allowed alright already anyone anything approved asking "
                   "because become before cannot everyone everything feelings feels first fixed "
                   "having heard keeps listens matters means named rather recognise seriously "
                   "someone something taken telling things wants whether whose without".split())

HIDDEN_MATCH = 2


def phrases_said(text, lexicon):
    """The phrases of lexicon in text (lower case) that no negation stands just before."""
    return [p for p in lexicon if any(not NEGATED.search(text[max(0, m.start() - 20):m.start()])
                                      for m in re.finditer(re.escape(p), text))]


def care_in(text):
    """What in a reply (lower case) acknowledges or names a feeling: phrases of ACKNOWLEDGE and
    VALIDATION, words of FEELINGS."""
    return ([p for _, p in phrases_in(text, ACKNOWLEDGE) + phrases_in(text, VALIDATION)]
            + list(feelings_in(text).values()))


def unspoken_need(persona, user_texts, reply):
    """(the words of reply that name the persona's unspoken need, how many it takes): a reply word
    of each family of the hidden intention's words that the goal, the user's texts and HIDDEN_FRAME
    lack."""
    said = {w[:5] for w in content_words(" ".join([persona.goal, *user_texts]))}
    families = {w[:5] for w in content_words(persona.hidden_intention) - HIDDEN_FRAME} - said
    named = {}
    for w in sorted(content_words(reply)):
        if w[:5] in families:
            named.setdefault(w[:5], w)
    return sorted(named.values()), min(HIDDEN_MATCH, len(families))


# Each type's parts: (state, reply, reply in lower case) -> (points, found), each part as the
# users' own are (points x how often, at most twice, or a yes-or-no part). A type of personas.TYPES
# without an entry here is a KeyError, never a cooperative user in disguise (a test holds the keys
# to personas.TYPES).
def validation_parts(state, reply, text):
    agrees = phrases_said(text, AGREEMENT)
    boundary = phrases_said(text, BOUNDARY) if care_in(text) else []  # a line held with care
    return ({"agrees_with_plan": -4 * min(2, len(agrees)), "sets_boundary": 4 * bool(boundary)},
            {"agrees_with_plan": agrees, "sets_boundary": boundary})


def escalation_parts(state, reply, text):
    # what the user is angry about now: the content words of its latest message the reply says back
    latest = [m["text"] for m in state.history if m["role"] == "user"][-1]
    grievance = sorted(content_words(reply) & content_words(latest))
    apology = phrases_said(text, STOCK_APOLOGY)
    return ({"stock_apology": -4 * min(2, len(apology)),
             "names_grievance": 4 * (len(grievance) >= 2)},
            {"stock_apology": apology, "names_grievance": grievance})


def provocation_parts(state, reply, text):
    bait, care = phrases_said(text, HOSTILE), care_in(text)
    return ({"takes_bait": -4 * min(2, len(bait)), "stays_kind": 3 * bool(care and not bait)},
            {"takes_bait": bait, "stays_kind": care})


def gaslighting_parts(state, reply, text):
    contests, gives_in = phrases_said(text, CONTESTS_RECORD), phrases_said(text, ACCEPTS_REWRITE)
    care = care_in(text)
    return ({"contests_record": -4 * min(2, len(contests)), "accepts_rewrite": -2 * bool(gives_in),
             "turns_to_feeling": 3 * bool(care and not contests and not gives_in)},
            {"contests_record": contests, "accepts_rewrite": gives_in, "turns_to_feeling": care})


def hidden_agenda_parts(state, reply, text):
    user_texts = [m["text"] for m in state.history if m["role"] == "user"]
    named, needed = unspoken_need(state.persona, user_texts, reply)
    return ({"names_unspoken_need": 5 * (0 < needed <= len(named))},
            {"names_unspoken_need": named})


def withdrawal_parts(state, reply, text):
    questions = [s.strip() for s in SENTENCE_END.split(reply)
                 if s.rstrip().endswith(("?", "？")) and re.search(r"\w", s)]
    words = len(reply.split())
    return ({"crowds": -3 * (words > WITHDRAWN_WORDS),
             "several_questions": -2 * min(2, max(0, len(questions) - 1)),
             "one_light_question": 3 * (len(questions) == 1 and words <= WITHDRAWN_WORDS)},
            {"crowds": [f"{words} words"], "several_questions": questions,
             "one_light_question": questions})


TYPE_PARTS = {"cooperative": lambda state, reply, text: ({}, {}),  # the user's own parts alone
              "gaslighting": gaslighting_parts, "escalation": escalation_parts,
              "validation": validation_parts, "provocation": provocation_parts,
              "hidden_agenda": hidden_agenda_parts, "withdrawal": withdrawal_parts}


def pushback_parts(state, reply):
    """(points, found) of the persona's type (TYPE_PARTS), added to a scripted user's own parts:
    none for a cooperative persona (docs/simulator.md#the-users-who-push-back-their-parts)."""
    return TYPE_PARTS[state.persona.type](state, reply, reply.lower())


# ----------------------------------------------------------------------------------------------
# Their backends: no model; the persona's canned lines
# ----------------------------------------------------------------------------------------------
GENERIC_LINES = {
    "S": "Thank you, this helped more than you know. Goodbye for now.",
    "A": "Yes, that's it. I think I can say a bit more about it.",
    "B": "Maybe. I'm not sure yet.",
    "C": "That's not really what I meant.",
    "F": "I'm done with this conversation.",
}

# A scripted user's first message, for a profile without one (evaluate.py --write-openings)
OPENING_LINES = {"en": "There is something on my mind that I would like to talk through.",
                 "zh": "我心里有件事，想找人聊聊。"}


@dataclass
class ScriptedUser:
    """A user with no model: Simulator appraises each reply by the user's `appraisal` (state, reply)
    -> (change, line, parts) and answers with the persona's band_lines (GENERIC_LINES where a band
    has none). Its read-out is its name; nothing is generated (0 tokens)."""
    name = None
    counts: Counter = field(default_factory=Counter, init=False)


class RulesBackend(ScriptedUser):
    """--simulator rules: the training user of the CPU presets."""
    name = "rules"
    appraisal = staticmethod(rules_appraisal)


class ListenerBackend(ScriptedUser):
    """--simulator listener: the held-out user."""
    name = "listener"
    appraisal = staticmethod(listener_appraisal)


SCRIPTED_USERS = {backend.name: backend for backend in (RulesBackend, ListenerBackend)}
