"""The corpus and the questions: a synthetic world rendered as passages, asked about in two hops.

MuSiQue cannot be downloaded here, so the example makes data of the same kind. A seeded generator
builds a small world — countries, cities, companies, people — with attributes and relations
(``born_in``, ``works_for``, ``founded_by``, ``headquartered_in``, ``in_country``, ``founded_year``)
and renders every entity as short encyclopedia-style passages (a person has two: a biography and a
career note, so no single passage answers a question). Each question chains two relations, e.g.

    "In which country was Alma Varek born?"   Alma Varek --born_in--> Tessaly --in_country--> Veloria

and its gold answer is read off the world model, never written by hand, so it is certainly correct:
names are unique, every relation used is a function (one birthplace, one employer, one founder), and
a question whose two hops would collapse into one (asking who founded a person's own company) is
never generated, nor is one whose answer the subject's own passages already state (a shortcut).
``hops`` records the entity each hop has to be looked up by; the scripted model
uses it, the trained model never sees it.

The held-out split is by subject entity (crc32 of its name), so no test question is about a person
or company that a training question is about. Everything is a pure function of ``seed`` and
``scale``: no file is read, and two runs give the same corpus and questions.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "Passage",
    "World",
    "build_world",
    "default_data_dir",
    "load_tasks",
    "passages",
    "questions",
    "summary",
]

SEED = 12
#: the default world: 1100 people, 220 companies, 90 cities, 12 countries → 2 522 passages
DEFAULT_SCALE = 1100
TEST_FRACTION = 0.2

_SYLLABLES = (
    "ka lo ven dra mir tal bor sen ri an tes sa vor hal ne quin zar el mo pra dun fel gar is ol ur "
    "bel cor dal ith ren to ma vi su pel"
).split()
_CITY_ENDS = ("holm", "ford", "burg", "mouth", "stad", "wick", "port", "vale", "by", "ton")
_COUNTRY_ENDS = ("ia", "land", "mark", "ora", "istan", "avia")
_FIRST = (
    "Alma Boris Clara Dmitri Elena Farid Greta Hugo Ines Jonas Kira Luca Mara Nils Olga Pavel Rosa "
    "Stefan Tara Umar Vera Wim Yara Zeno Aiko Bruno Celia Dario Edith Felix Gemma Hans Ida Jorge Lena "
    "Milo Nadia Oskar Petra Rafael Selma Tomas Una Viktor Wanda Xenia Yusuf Zora"
).split()
_INDUSTRIES = {
    "Labs": "biotechnology",
    "Systems": "software",
    "Foods": "food processing",
    "Motors": "automotive",
    "Textiles": "textile",
    "Pharma": "pharmaceutical",
    "Logistics": "shipping",
    "Energy": "energy",
    "Media": "publishing",
    "Robotics": "robotics",
}
_OCCUPATIONS = (
    "chemist engineer accountant designer geologist economist architect pilot journalist "
    "translator lawyer biologist analyst surveyor chef programmer"
).split()
_FIELDS = "chemistry physics history economics law music mathematics biology linguistics".split()
_RIVERS = "Amber Silver Grey Swift Quiet Long Red Black Willow Stone".split()


@dataclass(frozen=True)
class Passage:
    id: int
    title: str
    text: str


@dataclass
class World:
    """Entities by name; every relation maps a name to exactly one name (or a year)."""

    countries: list[str] = field(default_factory=list)
    city_country: dict[str, str] = field(default_factory=dict)
    city_info: dict[str, tuple[int, str]] = field(default_factory=dict)  # population, river
    #: industry, year, founder, hq, staff
    company_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    person_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # born_in, year, job, employer, ...


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _word(rng: random.Random, used: set[str], n: tuple[int, int], end: tuple[str, ...] = ("",)) -> str:
    while True:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(*n))) + rng.choice(end)
        word = word.capitalize()
        if word not in used and len(word) >= 4:
            used.add(word)
            return word


@lru_cache(maxsize=4)
def build_world(seed: int = SEED, scale: int = DEFAULT_SCALE) -> World:
    """The world for ``seed``; ``scale`` people (companies, cities, countries scale with it)."""
    if scale < 20:
        raise ValueError(f"scale must be >= 20 people, got {scale}")
    rng = random.Random(seed)
    used: set[str] = set()
    world = World()
    n_countries = max(3, min(12, scale // 40))
    n_cities = max(6, scale * 9 // 110)
    n_companies = max(5, scale // 5)
    world.countries = [_word(rng, used, (2, 2), _COUNTRY_ENDS) for _ in range(n_countries)]
    for i in range(n_cities):
        city = _word(rng, used, (1, 2), _CITY_ENDS)
        # every country gets cities; the rest are spread at random
        world.city_country[city] = world.countries[i] if i < n_countries else rng.choice(world.countries)
        world.city_info[city] = (rng.randrange(5, 900) * 1000, rng.choice(_RIVERS))
    cities = list(world.city_country)
    people: list[str] = []
    while len(people) < scale:
        # surnames may repeat (full names may not) but never equal a place or company word
        surname = "".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize()
        name = f"{rng.choice(_FIRST)} {surname}"
        if surname not in used and name not in world.person_info:
            people.append(name)
            world.person_info[name] = {
                "born_in": rng.choice(cities),
                "year": rng.randrange(1940, 2000),
                "job": rng.choice(_OCCUPATIONS),
                "field": rng.choice(_FIELDS),
                "freelance": rng.randrange(2, 12),
            }
    founders = rng.sample(people, n_companies)
    companies = []
    surnames = {p.split()[1] for p in people}
    for founder in founders:
        suffix = rng.choice(list(_INDUSTRIES))
        name = f"{_word(rng, used | surnames, (3, 3))} {suffix}"
        used.add(name.split()[0])
        companies.append(name)
        world.company_info[name] = {
            "industry": _INDUSTRIES[suffix],
            "year": rng.randrange(1950, 2020),
            "founder": founder,
            "hq": rng.choice(cities),
            "staff": rng.randrange(2, 400) * 10,
        }
        world.person_info[founder]["employer"] = name
    for person in people:
        world.person_info[person].setdefault("employer", rng.choice(companies))
    return world


def passages(world: World) -> list[Passage]:
    """Every entity rendered as text: the retrieval corpus, in a fixed order."""
    out: list[tuple[str, str]] = []
    for country in world.countries:
        cities = sorted(c for c, k in world.city_country.items() if k == country)
        out.append((country, f"{country} is a country. Its cities include {', '.join(cities[:6])}."))
    for city, country in world.city_country.items():
        population, river = world.city_info[city]
        out.append(
            (
                city,
                f"{city} is a city in {country} with about {population:,} inhabitants. "
                f"It lies on the {river} river.",
            )
        )
    for company, c in world.company_info.items():
        out.append(
            (
                company,
                f"{company} is {_a(c['industry'])} company founded in {c['year']} by {c['founder']}. "
                f"Its headquarters are in {c['hq']}, and it employs about {c['staff']} people.",
            )
        )
    for person, p in world.person_info.items():
        out.append(
            (
                person,
                f"{person} (born {p['year']}) is {_a(p['job'])} who was born in {p['born_in']}. "
                f"{person} studied {p['field']} at university.",
            )
        )
        out.append(
            (
                person,
                f"{person} works for {p['employer']} as {_a(p['job'])}. Before that, {person} "
                f"spent {p['freelance']} years as a freelance {p['job']}.",
            )
        )
    return [Passage(i, title, text) for i, (title, text) in enumerate(out)]


def _person_questions(world: World, person: str) -> list[dict[str, Any]]:
    p = world.person_info[person]
    city, company = p["born_in"], p["employer"]
    c = world.company_info[company]
    qs = [("born_country", f"In which country was {person} born?", [person, city], world.city_country[city])]
    # never asked: questions whose answer the subject's own passages already state (a shortcut)
    if c["hq"] != city:
        qs.append(
            (
                "employer_hq",
                f"In which city is the company that {person} works for headquartered?",
                [person, company],
                c["hq"],
            )
        )
    if c["year"] != p["year"]:
        qs.append(
            (
                "employer_year",
                f"In which year was the company {person} works for founded?",
                [person, company],
                str(c["year"]),
            )
        )
    if c["founder"] != person:  # for a founder this is a one-hop self-reference
        qs.append(
            (
                "employer_founder",
                f"Who founded the company that {person} works for?",
                [person, company],
                c["founder"],
            )
        )
    return [{"kind": k, "question": q, "hops": h, "answer": a, "subject": person} for k, q, h, a in qs]


def _company_questions(world: World, company: str) -> list[dict[str, Any]]:
    c = world.company_info[company]
    founder, hq = c["founder"], c["hq"]
    qs = [
        {
            "kind": "hq_country",
            "question": f"In which country is {company} headquartered?",
            "hops": [company, hq],
            "answer": world.city_country[hq],
            "subject": company,
        }
    ]
    if world.person_info[founder]["born_in"] != hq:
        qs.append(
            {
                "kind": "founder_birthplace",
                "question": f"In which city was the founder of {company} born?",
                "hops": [company, founder],
                "answer": world.person_info[founder]["born_in"],
                "subject": company,
            }
        )
    return qs


def is_test(subject: str) -> bool:
    """The held-out split: by subject entity, stable across runs and Python versions."""
    return zlib.crc32(subject.encode()) % 100 < TEST_FRACTION * 100


def questions(world: World, seed: int = SEED) -> list[dict[str, Any]]:
    """One 2-hop question per person and per company, its kind drawn at random; ids are stable."""
    rng = random.Random(seed + 1)
    out = []
    for person in world.person_info:
        out.append(rng.choice(_person_questions(world, person)))
    for company in world.company_info:
        out.append(rng.choice(_company_questions(world, company)))
    for i, q in enumerate(out):
        q["id"] = f"q{i:05d}"
        q["split"] = "test" if is_test(q["subject"]) else "train"
    return out


def load_tasks(
    split: str = "train", *, scale: int = DEFAULT_SCALE, seed: int = SEED, limit: int | None = None
) -> list[dict[str, Any]]:
    """The tasks of ``split`` (``train`` or ``test``), in a fixed shuffled order (so ``limit`` picks a
    mix of question kinds). A task is ``{id, question, answer, hops, kind, subject, scale, seed}``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    tasks = [
        {**q, "scale": scale, "seed": seed}
        for q in questions(build_world(seed, scale), seed)
        if q["split"] == split
    ]
    random.Random(seed + 2).shuffle(tasks)
    return tasks[:limit] if limit is not None else tasks


def default_data_dir() -> Path:
    """Where the corpus embeddings are cached: ``$AGL_EXAMPLES_DATA/rag_agent``, else
    ``~/.cache/agl/examples/rag_agent`` (the agl cache dir)."""
    env = os.environ.get("AGL_EXAMPLES_DATA")
    if env:
        return Path(env).expanduser() / "rag_agent"
    from agl.chat.models import cache_dir

    return cache_dir() / "examples" / "rag_agent"


def summary(scale: int = DEFAULT_SCALE, seed: int = SEED) -> str:
    world = build_world(seed, scale)
    qs = questions(world, seed)
    kinds: dict[str, int] = {}
    for q in qs:
        kinds[q["kind"]] = kinds.get(q["kind"], 0) + 1
    n_test = sum(1 for q in qs if q["split"] == "test")
    return (
        f"{len(world.person_info)} people, {len(world.company_info)} companies, {len(world.city_country)} "
        f"cities, {len(world.countries)} countries → {len(passages(world))} passages\n"
        f"{len(qs)} questions ({len(qs) - n_test} train, {n_test} test): "
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    )
