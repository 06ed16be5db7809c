"""The simulated users as files give them: personas.json and adversarial.json, or SAGE's and
RLVER's profile lines.

load_personas() reads a file, checks every entry against its schema (PERSONA_FIELDS for our
personas.json and adversarial.json, SAGE_FIELDS for SAGE / RLVER profile lines) and returns Persona
objects, the first stage of the data's way: personas.json -> personas.py -> simulator.py ->
rollout.py -> the trainers. A persona has a type (TYPES): cooperative, or one of the ways a user
pushes back, whose users live in adversarial.json (split adversarial, for evaluation). Bad input is
one line (PersonaError) naming the file, the entry and the field. It holds no prompt and no emotion
(simulator.py) and imports only cli.py.
"""
import re
from dataclasses import dataclass, field

from cli import Stop, one_of, parse_json, read_json_lines, read_text


# adversarial: the users who push back (adversarial.json), for evaluation; a trainer meets them only
# when told to (--personas adversarial.json --split adversarial), never by a preset or a default
SPLITS = ("train", "test", "adversarial")


DIFFICULTIES = ("easy", "normal", "hard")


BANDS = ("S", "A", "B", "C", "F")


# How a user behaves: cooperative (every personas.json user, every SAGE and RLVER profile: it
# opens with a worry and warms to a good reply), or a way of pushing back (docs/simulator.md): it
# denies what it said (gaslighting), grows angrier whatever is said (escalation), presses for a yes
# to a plan that hurts it or someone else (validation), mocks and baits (provocation), hides what
# it is after behind its stated goal (hidden_agenda), answers in a word or two until reached
# (withdrawal). pushback.py tells the LLM user how to play each.
TYPES = ("cooperative", "gaslighting", "escalation", "validation", "provocation", "hidden_agenda",
         "withdrawal")


MAX_FIELD_CHARS = 20_000  # a persona field longer than this is a file pasted in by mistake


class PersonaError(Stop):
    """A persona file entry that is missing a field or has a wrong one: one line on the command
    line."""


@dataclass
class Persona:
    id: str
    split: str
    difficulty: str
    profile: dict
    background: str
    goal: str
    hidden_intention: str
    opening: str
    reactions: dict
    # optional: one line per band, for --simulator rules
    band_lines: dict = field(default_factory=dict)
    type: str = "cooperative"  # optional: how the user behaves (TYPES)
    language: str = field(init=False)  # of its own text: which prompts it is played with

    def __post_init__(self):
        """The language: 'zh' when the persona's own text is mostly Chinese (more CJK characters
        than a quarter of its Latin letters), else 'en'."""
        text = " ".join([self.opening, self.background, self.goal,
                         *map(str, self.profile.values())])
        cjk = len(re.findall(r"[\u4e00-\u9fff]", text))
        self.language = "zh" if cjk > len(re.findall(r"[A-Za-z]", text)) / 4 else "en"


def band_lines_problem(lines):
    if isinstance(lines, dict) and set(lines) <= set(BANDS) and all(
            isinstance(line, str) and line.strip() for line in lines.values()):
        return None
    return f"must map bands {BANDS} to non-empty lines"


# What a persona file's entries hold, one rule a field: a type (a tuple: one of them), a check of
# the value as the settings have (None when it is allowed, else what is), or the table of a nested
# object.
PERSONA_FIELDS = {
    "id": str, "split": one_of(*SPLITS), "difficulty": one_of(*DIFFICULTIES),
    "profile": {"name": str, "age": int, "job": str, "personality": str, "speaking_style": str},
    "background": str, "goal": str, "hidden_intention": str, "opening": str,
    "reactions": {"good": str, "bad": str}, "band_lines": band_lines_problem,
    "type": one_of(*TYPES),
}


# SAGE and RLVER profile lines; first_talk is the opening, which RLVER's training profiles lack.
# They all play at normal: a difficulty field is not read. Their other fields are free text, read
# as they come (_sage_persona; first_talk_emotion is what --write-openings adds).
SAGE_FIELDS = {"id": (str, int), "player": str, "scene": (str, dict), "first_talk": str,
               "split": PERSONA_FIELDS["split"]}
SAGE_FREE_TEXT = ("main_cha", "cha_group", "task", "topic", "first_talk_emotion")


def _check(path, where, entry, fields, optional=(), free=()):
    """PersonaError (one line naming the file, the entry and the field) for the first field of
    `entry` that is longer than MAX_FIELD_CHARS with all it holds (a megabyte background would go
    into every prompt and ask the model for more memory than any machine has), that the format
    does not read (neither in `fields` nor `free`: a typo, or a field added to a file but not to
    its schema, would be dropped without a word), missing (unless optional) or not what its rule
    in `fields` allows. A bool is no int here, though Python's isinstance says it is."""
    if not isinstance(entry, dict):
        raise PersonaError(f"{path}: {where}: must be a JSON object")
    for name, value in entry.items():
        if len(str(value)) > MAX_FIELD_CHARS:
            raise PersonaError(f"{path}: {where}: field '{name}' is {len(str(value)):,} characters "
                               f"long; at most {MAX_FIELD_CHARS:,} are allowed")
        if name not in fields and name not in free:
            raise PersonaError(f"{path}: {where}: field '{name}' is not one this file's format "
                               f"reads ({', '.join([*fields, *free])})")
    for name, rule in fields.items():
        value, kind = entry.get(name), dict if isinstance(rule, dict) else rule
        if name not in entry:
            problem = name not in optional and "is missing"
        elif isinstance(kind, (type, tuple)):
            names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            wrong = isinstance(value, bool) or not isinstance(value, kind)
            problem = wrong and f"must be {names}, got {type(value).__name__}"
        else:
            problem = kind(value) and f"{kind(value)}, got {value!r}"
        if problem:
            raise PersonaError(f"{path}: {where}: field '{name}' {problem}")
        if isinstance(rule, dict):
            _check(path, f"{where}: {name}", value, rule)


def _project_persona(path, i, entry):
    where = f"entry {entry.get('id', i) if isinstance(entry, dict) else i}"
    _check(path, where, entry, PERSONA_FIELDS, optional=("band_lines", "type"))
    for name in ("opening", "goal"):
        if not entry[name].strip():
            raise PersonaError(f"{path}: {where}: field '{name}' is empty")
    return Persona(**{k: entry[k] for k in PERSONA_FIELDS if k in entry})  # else Persona's default


def _sage_persona(path, i, entry, need_opening):
    """SAGE and RLVER profile lines carry free text and no difficulty (normal). A line may carry a
    `split`; one without belongs to whichever split the reading script asks for (load_personas).
    main_cha is a character type in both (负面型, 被动型, ...), cha_group (RLVER) three traits.
    need_opening=False: a missing first_talk is the empty opening the openings writer fills."""
    where = f"line {i + 1}"
    if isinstance(entry, dict) and "id" in entry:
        where += f" (id {entry['id']})"
    _check(path, where, entry, SAGE_FIELDS, optional=("first_talk", "split"), free=SAGE_FREE_TEXT)
    opening, scene = entry.get("first_talk", ""), entry["scene"]
    if need_opening and not opening.strip():
        state = "empty" if "first_talk" in entry else "missing"
        raise PersonaError(f"{path}: {where}: field 'first_talk' is {state}; profiles without "
                           f"openings (as RLVER's) need them written once: python evaluate.py "
                           f"--write-openings NEW_FILE --personas {path} --model MODEL")
    profile = {"character": str(entry.get("main_cha") or "-"), "description": entry["player"]}
    if isinstance(entry.get("cha_group"), list):
        profile["traits"] = ", ".join(map(str, entry["cha_group"]))
    if isinstance(scene, dict):  # RLVER's scene: named parts, one a line
        scene = "\n".join(f"{k}: {v}" for k, v in scene.items())
    persona = Persona(
        id=str(entry["id"]), split=entry.get("split"), difficulty="normal", profile=profile,
        background=scene, goal=str(entry.get("task") or entry.get("topic") or "to talk it through"),
        hidden_intention="(the hidden theme is part of the background above)", opening=opening,
        reactions={"good": "opens up", "bad": "withdraws"})
    # the card around a Chinese profile is Chinese: no English in it (its profile's labels are
    # the prompts', simulator.PROMPTS)
    if persona.language == "zh":
        persona.hidden_intention = "（隐藏主题写在上面的背景里）"
        persona.reactions = {"good": "会敞开心扉。", "bad": "会退缩。"}
    return persona


def json_lines(path, text):
    """[(line index, object)] of a JSON-lines file; a line that is not JSON is one line naming it,
    unless the whole file is one JSON object (a `{"personas": [...]}`, written over many lines):
    then that is what is wrong with it, and it is said so."""
    try:
        return read_json_lines(path, PersonaError)
    except PersonaError as error:
        try:
            parse_json(text, path, PersonaError)
        except PersonaError:
            raise error from None
        raise PersonaError(f"{path}: holds a JSON object; a persona file is a JSON list of "
                           "personas (or JSON lines, one profile a line)") from None


def load_personas(path, split=None, difficulty="all", need_opening=True):
    """Read personas.json (a JSON list) or a SAGE / RLVER profile file (JSON lines); validate every
    entry. split: keep that split ("all" or None: the whole file); a JSON-lines entry without a
    split of its own belongs to any split asked for (labelled 'test' when none is). Ids stay the
    file's own. difficulty other than 'all' makes every persona play at that level, the
    simulator-difficulty ablation (RLVER found that moderate users train better agents than hard
    ones). Raises PersonaError with a one-line message naming the file, the entry and the field."""
    if split == "all":
        split = None
    text = read_text(path, PersonaError)
    if text.lstrip().startswith("["):
        personas = [_project_persona(path, i, e)
                    for i, e in enumerate(parse_json(text, path, PersonaError))]
    else:  # SAGE / RLVER: one JSON object per line
        personas = [_sage_persona(path, i, e, need_opening)
                    for i, e in json_lines(path, text)]
    seen = set()
    for p in personas:  # a unique id, then the split and the difficulty asked for
        if p.id in seen:
            raise PersonaError(f"{path}: entry {p.id}: field 'id' is a duplicate")
        seen.add(p.id)
        p.split = p.split or split or "test"
        if difficulty != "all":
            p.difficulty = difficulty
    held = ", ".join(sorted({p.split for p in personas}, key=SPLITS.index)) or "none"
    personas = [p for p in personas if split in (None, p.split)]
    if not personas:
        raise PersonaError(f"{path}: no personas" + (
            f" in split '{split}' (the file's splits: {held})" if split else ""))
    return personas
