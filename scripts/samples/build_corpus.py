"""Build the reproducible 5-domain training corpus for moeviz's sample MoE models.

Domains (one sub-folder each, with ``train.txt`` and ``eval.txt``):

- ``english``  -- CPython's ``pydoc_data.topics.topics`` (sorted keys), ~470 KB (PSF-2.0);
- ``python``   -- top-level ``*.py`` files of the standard library in sorted order, ~1 MB (PSF-2.0);
- ``bible_en`` -- from the World English Bible (Debian ``sword-text-web``), ~1 MB (public domain);
- ``bible_es`` -- Reina-Valera 1909 (Debian ``sword-text-sparv``), ~1 MB (public domain), verse-parallel
  to ``bible_en`` (same chapters and verses, one verse per line, in canonical order);
- ``data``     -- synthetic CSV rows, JSON lines and arithmetic from a seeded generator, ~1 MB (own work).

Every domain is a list of chunks (a few KB of text, or one Bible chapter); every Nth chunk is held out
for evaluation (~50 KB per domain), the rest is training text. ``manifest.json`` records the size and
sha256 of every file, the Python version and the Debian package versions. Running twice gives identical
bytes.

    python scripts/samples/build_corpus.py [OUT] [--debs DIR] [--seed N] [--export-eval DIR]
    python scripts/samples/build_corpus.py --smoke OUT      # a few KB per domain, no apt, seconds

Smoke mode reads the Bible domains from the committed eval slices in ``sample_models/eval/``.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import math
import platform
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
COMMITTED_EVAL = REPO / "sample_models" / "eval"
DOMAINS = ("english", "python", "bible_en", "bible_es", "data")

SEED = 0
CHUNK_BYTES = 4096  # chunk size for the non-Bible domains (cut at line boundaries)
EVAL_BYTES = 50_000  # target size of each held-out slice
PYTHON_BYTES = 1_000_000
DATA_BYTES = 1_000_000
BIBLE_CHAPTER_STRIDE = 4  # keep every 4th parallel chapter: ~1 MB per language
BIBLE_EVAL_STRIDE = 20  # of the kept chapters, every 20th is held out
MAX_MISMATCH = 0.2  # mean |log length ratio| above which a chapter counts as misaligned (p99 is ~0.2)
SHIFT_GAIN = 0.62  # ... or when shifting part of it by one verse lowers that to below this fraction

# Debian package -> SWORD module name inside it.
BIBLE_PACKAGES = {
    "bible_en": ("sword-text-web", "engWEB2015eb"),
    "bible_es": ("sword-text-sparv", "spaRV1909eb"),
}

SMOKE_BYTES = 4096  # per-domain text size in smoke mode
SMOKE_CHUNK_BYTES = 512
SMOKE_BIBLE_LINES = 48
SMOKE_BIBLE_CHUNK_LINES = 8


# ---------------------------------------------------------------------------------------------- chunks


def line_chunks(text: str, size: int) -> list[str]:
    """Split ``text`` into chunks of about ``size`` bytes, cutting only after a newline."""
    chunks: list[str] = []
    current: list[str] = []
    n = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        n += len(line.encode())
        if n >= size:
            chunks.append("".join(current))
            current, n = [], 0
    if current:
        chunks.append("".join(current))
    return chunks


def document_chunks(documents: list[str], size: int) -> list[str]:
    """Chunk each document separately (a chunk never spans two documents); documents end in a blank line."""
    chunks: list[str] = []
    for doc in documents:
        doc_chunks = line_chunks(doc.rstrip("\n") + "\n", size)
        doc_chunks[-1] += "\n"
        chunks.extend(doc_chunks)
    return chunks


def eval_stride(chunks: list[str], target: int = EVAL_BYTES) -> int:
    """Hold out every Nth chunk, with N chosen so the held-out part is about ``target`` bytes."""
    total = sum(len(c.encode()) for c in chunks)
    return max(2, round(total / target))


def split(chunks: list[str], stride: int) -> tuple[str, str]:
    """(train, eval) text: chunk ``i`` is held out when ``i % stride == stride // 2``."""
    train = [c for i, c in enumerate(chunks) if i % stride != stride // 2]
    held = [c for i, c in enumerate(chunks) if i % stride == stride // 2]
    return "".join(train), "".join(held)


# ------------------------------------------------------------------------------------ english / python


def english_documents() -> list[str]:
    """The pydoc topic texts, in sorted key order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def python_documents(limit: int = PYTHON_BYTES) -> tuple[list[str], list[str]]:
    """Top-level stdlib ``*.py`` files in sorted order until ``limit`` bytes: (texts, file names).

    ``_sysconfigdata_*.py`` is skipped: it is generated per platform and build, so not reproducible.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    names: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py"), key=lambda p: p.name):
        if total >= limit:
            break
        if path.name.startswith("_sysconfigdata"):
            continue
        text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
        texts.append(text)
        names.append(path.name)
        total += len(text.encode())
    return texts, names


# ------------------------------------------------------------------------------------------- synthetic


class Rng:
    """Integers and choices built only on ``random.Random.random()``, whose sequence for a given integer
    seed is guaranteed stable across Python versions (``randrange``/``choice`` are not)."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def below(self, n: int) -> int:
        return int(self._random.random() * n)

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def pick(self, items: tuple[str, ...]) -> str:
        return items[self.below(len(items))]

    def money(self, lo: int, hi: int) -> str:
        return f"{self.between(lo * 100, hi * 100) / 100:.2f}"

    def date(self) -> str:
        return f"{self.between(2015, 2024)}-{self.between(1, 12):02d}-{self.between(1, 28):02d}"


NAMES = (
    "Ada", "Alan", "Bea", "Carlos", "Chen", "Dana", "Elena", "Farah", "Grace", "Hugo", "Ines", "Jamal",
    "Kenji", "Lena", "Marta", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tomas", "Uma", "Yara",
)  # fmt: skip
CITIES = (
    "Lisbon", "Madrid", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Cairo", "Dublin", "Hanoi",
    "Quito", "Perth", "Krakow", "Austin", "Seoul", "Accra",
)  # fmt: skip
PRODUCTS = ("widget", "gadget", "bolt", "cable", "lamp", "kettle", "notebook", "pencil", "sensor", "valve")
STATUSES = ("ok", "pending", "failed", "shipped", "cancelled")
TAGS = ("alpha", "beta", "gamma", "red", "green", "blue", "urgent", "archived", "new")


def csv_block(rng: Rng) -> list[str]:
    """A CSV table (header + rows) with one of three schemas."""
    kind = rng.below(3)
    rows = rng.between(4, 14)
    if kind == 0:
        lines = ["id,name,city,age,score"]
        start = rng.between(1, 900)
        for i in range(rows):
            name, city = rng.pick(NAMES), rng.pick(CITIES)
            lines.append(f"{start + i},{name},{city},{rng.between(18, 90)},{rng.between(0, 100)}")
    elif kind == 1:
        lines = ["order_id,date,product,quantity,unit_price,total"]
        for _ in range(rows):
            qty, cents = rng.between(1, 20), rng.between(50, 9999)
            lines.append(
                f"A{rng.between(10000, 99999)},{rng.date()},{rng.pick(PRODUCTS)},{qty},"
                f"{cents / 100:.2f},{qty * cents / 100:.2f}"
            )
    else:
        lines = ["date,city,temp_c,humidity,rain_mm"]
        city = rng.pick(CITIES)
        for _ in range(rows):
            lines.append(
                f"{rng.date()},{city},{rng.between(-150, 400) / 10:.1f},{rng.between(10, 100)},"
                f"{rng.between(0, 300) / 10:.1f}"
            )
    return lines


def json_block(rng: Rng) -> list[str]:
    """A few JSON lines with one of three record shapes."""
    kind = rng.below(3)
    lines = []
    for _ in range(rng.between(3, 10)):
        if kind == 0:
            record: dict[str, object] = {
                "id": rng.between(1, 99999),
                "user": rng.pick(NAMES).lower(),
                "active": rng.below(2) == 1,
                "tags": [rng.pick(TAGS) for _ in range(rng.below(4))],
            }
        elif kind == 1:
            record = {
                "event": rng.pick(("login", "logout", "purchase", "view", "error")),
                "ts": f"{rng.date()}T{rng.between(0, 23):02d}:{rng.between(0, 59):02d}:00Z",
                "status": rng.pick(STATUSES),
                "amount": float(rng.money(0, 500)),
            }
        else:
            record = {
                "sensor": f"{rng.pick(PRODUCTS)}-{rng.between(1, 64)}",
                "city": rng.pick(CITIES),
                "reading": {"value": rng.between(-1000, 1000) / 10, "unit": rng.pick(("C", "kPa", "V"))},
                "ok": rng.below(5) != 0,
            }
        lines.append(json.dumps(record, ensure_ascii=False))
    return lines


def arithmetic_block(rng: Rng) -> list[str]:
    """Correct integer equations such as ``37 + 58 = 95``."""
    lines = []
    for _ in range(rng.between(5, 18)):
        op = rng.below(4)
        if op == 0:
            a, b = rng.between(0, 999), rng.between(0, 999)
            lines.append(f"{a} + {b} = {a + b}")
        elif op == 1:
            a, b = rng.between(0, 999), rng.between(0, 999)
            lines.append(f"{max(a, b)} - {min(a, b)} = {max(a, b) - min(a, b)}")
        elif op == 2:
            a, b = rng.between(0, 99), rng.between(0, 99)
            lines.append(f"{a} * {b} = {a * b}")
        else:
            b, q = rng.between(1, 30), rng.between(0, 99)
            lines.append(f"{b * q} / {b} = {q}")
    return lines


def data_documents(seed: int, limit: int) -> list[str]:
    """Random blocks (CSV, JSON lines, arithmetic) until ``limit`` bytes."""
    rng = Rng(seed)
    makers: tuple[Callable[[Rng], list[str]], ...] = (csv_block, json_block, arithmetic_block)
    documents: list[str] = []
    total = 0
    while total < limit:
        doc = "\n".join(makers[rng.below(len(makers))](rng)) + "\n"
        documents.append(doc)
        total += len(doc.encode()) + 1
    return documents


# ----------------------------------------------------------------------------------------------- bibles


@dataclass(frozen=True)
class DebInfo:
    """A downloaded Debian package."""

    package: str
    version: str
    path: Path
    sha256: str


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_deb(package: str, cache: Path) -> DebInfo:
    """The package's .deb from ``cache``, downloading it with ``apt-get download`` when absent."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{package}_*.deb"))
    if not found:
        hint = (
            f"Could not fetch the Debian package {package!r} with `apt-get download {package}`"
            f" (into {cache}).\n"
            "  - on Debian/Ubuntu: run `apt-get update` (as root) and retry;\n"
            f"  - elsewhere: put {package}_*.deb (from https://packages.debian.org/{package}) into {cache};\n"
            "  - `dpkg-deb` is also needed (Debian package `dpkg`);\n"
            "  - or build the small CI corpus without apt: build_corpus.py --smoke OUT."
        )
        if shutil.which("apt-get") is None:
            raise SystemExit(f"error: apt-get not found.\n{hint}")
        result = subprocess.run(
            ["apt-get", "download", package], cwd=cache, capture_output=True, text=True, check=False
        )
        found = sorted(cache.glob(f"{package}_*.deb"))
        if result.returncode != 0 or not found:
            raise SystemExit(f"error: apt-get download failed:\n{result.stderr.strip()}\n{hint}")
    if len(found) > 1:
        print(f"note: several {package} debs in {cache}; using {found[-1].name}", file=sys.stderr)
    deb = found[-1]
    version = run_dpkg_deb(["-f", str(deb), "Version"]).strip()
    return DebInfo(package, version, deb, sha256_file(deb))


def run_dpkg_deb(args: list[str]) -> str:
    if shutil.which("dpkg-deb") is None:
        raise SystemExit("error: dpkg-deb not found; install the Debian package `dpkg`.")
    return subprocess.run(["dpkg-deb", *args], capture_output=True, text=True, check=True).stdout


def ztext_entries(module: Path, testament: str) -> list[bytes]:
    """All index entries of one testament (``ot``/``nt``) of a SWORD zText module, raw markup bytes."""
    bzs = (module / f"{testament}.bzs").read_bytes()
    bzv = (module / f"{testament}.bzv").read_bytes()
    bzz = (module / f"{testament}.bzz").read_bytes()
    blocks: dict[int, bytes] = {}
    entries: list[bytes] = []
    for block, offset, length in struct.iter_unpack("<IIH", bzv):
        if length == 0:
            entries.append(b"")
            continue
        if block not in blocks:
            start, size, _ = struct.unpack_from("<III", bzs, 12 * block)
            blocks[block] = zlib.decompress(bzz[start : start + size])
        entries.append(blocks[block][offset : offset + length])
    return entries


CHAPTER_RE = re.compile(r'<chapter\b[^>]*\bsID="([^"]+)\.(\d+)"')
BOOK_START_RE = re.compile(r'<div\b(?=[^>]*\btype="book")(?=[^>]*\bsID=)[^>]*\bosisID="([^"]+)"')
Chapters = dict[tuple[str, int], list[str]]


def read_chapters(module: Path) -> Chapters:
    """Raw verse markup per (OSIS book, chapter), in module order.

    The SWORD index lays out, per testament: module heading, testament heading, then per book a book
    heading and per chapter a chapter heading (verse 0, which holds the ``<chapter sID=...>`` marker)
    followed by verses 1..n. So the verses of a chapter are the entries between its marker and the next
    one, less the next book's heading when the book changes.
    """
    chapters: Chapters = {}
    for testament in ("ot", "nt"):
        entries = [e.decode("utf-8") for e in ztext_entries(module, testament)]
        markers = []
        for i, entry in enumerate(entries):
            found = CHAPTER_RE.findall(entry)
            if not found or BOOK_START_RE.search(entry):
                continue  # a book heading holds the chapter markers of books outside the versification
            if len(found) > 1:
                raise ValueError(f"{module.name}: entry {i} has several chapter markers {found}")
            markers.append((i, found[0][0], int(found[0][1])))
        for k, (index, book, number) in enumerate(markers):
            previous = markers[k - 1] if k else None
            expected = previous[2] + 1 if previous and previous[1] == book else 1
            if number != expected:
                raise ValueError(f"{module.name}: chapter {book}.{number} out of order (expected {expected})")
            if k + 1 == len(markers):
                end = len(entries)
            elif markers[k + 1][1] == book:
                end = markers[k + 1][0]
            else:
                end = markers[k + 1][0] - 1
                next_book = markers[k + 1][1]
                if entries[end] and not BOOK_START_RE.search(entries[end]):
                    raise ValueError(f"{module.name}: entry {end} before {next_book} is not a book heading")
            chapters[(book, number)] = entries[index + 1 : end]
    return chapters


CHAPTER_END_RE = re.compile(r"<chapter\b[^>]*\beID=")  # what follows is outside the chapter
NOTE_RE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)
TITLE_RE = re.compile(r"<title\b([^>]*)>(.*?)</title>", re.S)
SPEAKER_RE = re.compile(r"<speaker\b[^>]*>.*?</speaker>", re.S)
# Tags that separate words (line, paragraph, division, milestone ...) become a space; others vanish.
INLINE_TAGS = "w|transChange|q|seg|name|catchWord|rdg|reference|hi|foreign|divineName|rf|added"
BLOCK_TAG_RE = re.compile(rf"<(?!/?(?:{INLINE_TAGS})\b)[^>]*>")
TAG_RE = re.compile(r"<[^>]*>")
NOTE_MARK = "\x00"


def clean_verse(markup: str) -> str:
    """Plain text of one verse.

    Removes what follows the chapter's end marker, notes, non-canonical titles and speaker labels, strips
    tags, unescapes entities and collapses whitespace. Canonical titles (psalm superscriptions) are kept,
    as the Spanish text has them inline.
    """
    text = NOTE_RE.sub(NOTE_MARK, CHAPTER_END_RE.split(markup, maxsplit=1)[0])
    text = TITLE_RE.sub(lambda m: f" {m.group(2)} " if 'canonical="true"' in m.group(1) else " ", text)
    text = SPEAKER_RE.sub(" ", text)
    text = TAG_RE.sub("", BLOCK_TAG_RE.sub(" ", text))
    # A note sat where a space was ("God<note/>created") or before punctuation ("word<note/>.").
    text = re.sub(rf"{NOTE_MARK}+(?=[,.;:!?)\]’”»])", "", text)
    text = re.sub(rf"(?<=[(\[‘“«¿¡]){NOTE_MARK}+", "", text).replace(NOTE_MARK, " ")
    return " ".join(html.unescape(text).split())


def pair_cost(a: str, b: str, offset: float) -> float | None:
    """|log(len(a) / len(b)) - offset|, or None when a side is empty."""
    return abs(math.log(len(a) / len(b)) - offset) if a and b else None


def misaligned(en: list[str], es: list[str], offset: float) -> bool:
    """Whether a chapter's verses do not correspond one to one, judged from verse lengths.

    The Spanish text numbers a few chapters differently (e.g. Num 13, Jonah 2, the end of 1 Kings 22):
    either the lengths disagree a lot, or pairing English verse i with Spanish verse i +/- 1 from some
    verse on fits much better than the plain pairing.
    """
    n = len(en)
    plain = [pair_cost(en[i], es[i], offset) for i in range(n)]
    known = [c for c in plain if c is not None]
    cost = sum(known) / len(known) if known else 0.0
    if cost > MAX_MISMATCH:
        return True
    for shifted in (
        [pair_cost(en[i], es[i + 1], offset) for i in range(n - 1)],
        [pair_cost(en[i + 1], es[i], offset) for i in range(n - 1)],
    ):
        # Cost of "plain before verse `start`, shifted from it on", for every start, via running sums.
        head_sum = head_n = 0.0
        tail_sum = sum(c for c in shifted if c is not None)
        tail_n = sum(c is not None for c in shifted)
        for start in range(n - 3):
            if head_n + tail_n and (head_sum + tail_sum) / (head_n + tail_n) < SHIFT_GAIN * cost:
                return True
            if plain[start] is not None:
                head_sum, head_n = head_sum + plain[start], head_n + 1
            if shifted[start] is not None:
                tail_sum, tail_n = tail_sum - shifted[start], tail_n - 1
    return False


@dataclass
class Parallel:
    """Verse-aligned chapters of the two Bibles."""

    keys: list[tuple[str, int]]
    english: list[str]  # one string per chapter, one verse per line
    spanish: list[str]
    dropped: list[str]  # chapters left out as not one-to-one ("Book.chapter")


def parallel_chapters(en: Chapters, es: Chapters) -> Parallel:
    """Verse-aligned (English, Spanish) chapters in canonical (Spanish/KJV module) order.

    Only chapters present in both with the same number of verses are used (the two modules follow the
    NRSVA and KJV versifications, which differ in a few chapters), and not those that look
    :func:`misaligned`; only verses non-empty in both are kept.
    """
    candidates = []
    dropped = []
    for key, es_verses in es.items():
        en_verses = en.get(key)
        if en_verses is not None and len(en_verses) == len(es_verses):
            candidates.append((key, [clean_verse(v) for v in en_verses], [clean_verse(v) for v in es_verses]))
        else:
            dropped.append(f"{key[0]}.{key[1]}")
    # Typical log length ratio English/Spanish, the centre for the misalignment test.
    offset = statistics.median(
        math.log(len(a) / len(b))
        for _, en_v, es_v in candidates
        for a, b in zip(en_v, es_v, strict=True)
        if a and b
    )
    result = Parallel([], [], [], dropped)
    for key, en_verses, es_verses in candidates:
        lines = [(a, b) for a, b in zip(en_verses, es_verses, strict=True) if a and b]
        if not lines or misaligned(en_verses, es_verses, offset):
            result.dropped.append(f"{key[0]}.{key[1]}")
            continue
        result.keys.append(key)
        result.english.append("".join(a + "\n" for a, _ in lines))
        result.spanish.append("".join(b + "\n" for _, b in lines))
    order = {f"{book}.{chapter}": i for i, (book, chapter) in enumerate(es)}
    result.dropped.sort(key=order.__getitem__)
    return result


def read_bibles(cache: Path) -> tuple[Parallel, dict[str, DebInfo]]:
    """The parallel chapters of both Bibles (fetching and unpacking the packages), and the packages."""
    debs = {domain: fetch_deb(package, cache) for domain, (package, _) in BIBLE_PACKAGES.items()}
    chapters: dict[str, Chapters] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for domain, (_, module_name) in BIBLE_PACKAGES.items():
            root = Path(tmp) / domain
            run_dpkg_deb(["-x", str(debs[domain].path), str(root)])
            module = root / "usr/share/sword/modules/texts/ztext" / module_name
            if not module.is_dir():
                raise SystemExit(f"error: {debs[domain].path.name} has no SWORD module at {module}")
            chapters[domain] = read_chapters(module)
    return parallel_chapters(chapters["bible_en"], chapters["bible_es"]), debs


# ------------------------------------------------------------------------------------------------ build


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass
class Domain:
    """One domain's chunks and its held-out stride."""

    chunks: list[str]
    stride: int
    source: str
    details: dict[str, Any] = field(default_factory=dict)


def full_domains(cache: Path, seed: int) -> tuple[dict[str, Domain], dict[str, DebInfo]]:
    """All five domains at full size (needs apt-get/dpkg-deb or cached debs for the Bibles)."""
    english = document_chunks(english_documents(), CHUNK_BYTES)
    py_texts, py_names = python_documents()
    python = document_chunks(py_texts, CHUNK_BYTES)
    data = document_chunks(data_documents(seed, DATA_BYTES), CHUNK_BYTES)
    bibles, debs = read_bibles(cache)
    kept = slice(None, None, BIBLE_CHAPTER_STRIDE)
    chapters = {
        "aligned_chapters": len(bibles.keys),
        "chapters_used": f"every {BIBLE_CHAPTER_STRIDE}th aligned chapter, from {bibles.keys[0][0]}.1",
        "dropped_chapters": bibles.dropped,
    }
    web, rv = debs["bible_en"], debs["bible_es"]
    domains = {
        "english": Domain(english, eval_stride(english), "pydoc_data.topics.topics, sorted keys"),
        "python": Domain(python, eval_stride(python), f"stdlib {py_names[0]} .. {py_names[-1]}"),
        "bible_en": Domain(
            bibles.english[kept],
            BIBLE_EVAL_STRIDE,
            f"{web.package} {web.version} (World English Bible)",
            chapters,
        ),
        "bible_es": Domain(
            bibles.spanish[kept],
            BIBLE_EVAL_STRIDE,
            f"{rv.package} {rv.version} (Reina-Valera 1909)",
            chapters,
        ),
        "data": Domain(data, eval_stride(data), f"synthetic, seed {seed}"),
    }
    return domains, debs


def smoke_domains(seed: int) -> dict[str, Domain]:
    """A few KB per domain, no apt: the Bible domains come from the committed eval slices."""
    english = line_chunks("".join(english_documents())[:SMOKE_BYTES], SMOKE_CHUNK_BYTES)
    py_texts, _ = python_documents(SMOKE_BYTES)
    python = line_chunks("".join(py_texts)[:SMOKE_BYTES], SMOKE_CHUNK_BYTES)
    data = document_chunks(data_documents(seed, SMOKE_BYTES), SMOKE_CHUNK_BYTES)
    head = f"smoke: first ~{SMOKE_BYTES} bytes"
    domains = {
        "english": Domain(english, 4, f"{head} of pydoc_data.topics"),
        "python": Domain(python, 4, f"{head} of the stdlib files"),
        "data": Domain(data, 4, f"{head}, synthetic, seed {seed}"),
    }
    for name in ("bible_en", "bible_es"):
        path = COMMITTED_EVAL / f"{name}.txt"
        if not path.exists():
            raise SystemExit(f"error: smoke mode needs the committed eval slice {path}")
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)[:SMOKE_BIBLE_LINES]
        step = SMOKE_BIBLE_CHUNK_LINES
        chunks = ["".join(lines[i : i + step]) for i in range(0, len(lines), step)]
        source = f"smoke: first {SMOKE_BIBLE_LINES} verses of sample_models/eval/{name}.txt"
        domains[name] = Domain(chunks, 4, source)
    return {name: domains[name] for name in DOMAINS}


def build(out: Path, *, smoke: bool, cache: Path, seed: int) -> dict[str, Any]:
    """Write every domain's train/eval text and ``manifest.json`` into ``out``; return the manifest."""
    start = time.perf_counter()
    debs: dict[str, DebInfo] = {}
    if smoke:
        domains = smoke_domains(seed)
    else:
        domains, debs = full_domains(cache, seed)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in DOMAINS:
        domain = domains[name]
        train, held = split(domain.chunks, domain.stride)
        for part, text in (("train", train), ("eval", held)):
            write_text(out / name / f"{part}.txt", text)
            files[f"{name}/{part}.txt"] = file_entry(out / name / f"{part}.txt")
        info[name] = {
            "chunks": len(domain.chunks),
            "eval_every": domain.stride,
            "source": domain.source,
            **domain.details,
        }
    manifest: dict[str, Any] = {
        "generator": "scripts/samples/build_corpus.py",
        "smoke": smoke,
        "seed": seed,
        "python": platform.python_version(),
        "debian_packages": {
            d.package: {"version": d.version, "deb": d.path.name, "deb_sha256": d.sha256}
            for d in debs.values()
        },
        "domains": info,
        "files": files,
    }
    write_json(out / "manifest.json", manifest)
    for name in DOMAINS:
        train_b, eval_b = files[f"{name}/train.txt"]["bytes"], files[f"{name}/eval.txt"]["bytes"]
        print(f"  {name:9s} train {train_b:>9,d} B  eval {eval_b:>7,d} B  ({info[name]['source']})")
    print(f"built {out} in {time.perf_counter() - start:.1f} s")
    return manifest


def export_eval(corpus: Path, target: Path, manifest: dict[str, Any]) -> None:
    """Copy the eval slices to ``target/<domain>.txt`` and write ``target/manifest.json``."""
    target.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in DOMAINS:
        shutil.copyfile(corpus / name / "eval.txt", target / f"{name}.txt")
        files[f"{name}.txt"] = file_entry(target / f"{name}.txt")
    write_json(
        target / "manifest.json",
        {
            "generator": "scripts/samples/build_corpus.py --export-eval",
            "python": manifest["python"],
            "seed": manifest["seed"],
            "debian_packages": {k: v["version"] for k, v in manifest["debian_packages"].items()},
            "files": files,
        },
    )
    print(f"exported eval slices to {target}")


def compare_with_committed(manifest: dict[str, Any]) -> None:
    """Say whether the eval slices just built equal the committed ones (sample_models/eval/manifest.json)."""
    committed_path = COMMITTED_EVAL / "manifest.json"
    if not committed_path.exists():
        return
    committed = json.loads(committed_path.read_text(encoding="utf-8"))["files"]
    built = manifest["files"]
    differing = [
        name
        for name in DOMAINS
        if committed.get(f"{name}.txt", {}).get("sha256") != built[f"{name}/eval.txt"]["sha256"]
    ]
    if differing:
        print(
            f"warning: eval slices differ from {committed_path} for {', '.join(differing)} "
            "(another Python patch version or Debian package version?)",
            file=sys.stderr,
        )
    else:
        print(f"eval slices match the committed ones ({committed_path})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=REPO / "build" / "corpus", help="output folder")
    parser.add_argument("--smoke", action="store_true", help="tiny corpus (a few KB per domain), no apt")
    parser.add_argument("--debs", type=Path, default=REPO / "build" / "debs", help=".deb cache folder")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the synthetic data domain")
    parser.add_argument("--export-eval", type=Path, metavar="DIR", help="also copy eval slices to DIR")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke and args.export_eval:
        raise SystemExit("error: --export-eval needs a full build, not --smoke")
    manifest = build(args.out, smoke=args.smoke, cache=args.debs, seed=args.seed)
    if args.export_eval:
        export_eval(args.out, args.export_eval, manifest)
    elif not args.smoke:
        compare_with_committed(manifest)


if __name__ == "__main__":
    main()
