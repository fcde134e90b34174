"""Every check of a file name that reaches the pack from outside: widget values and the browser's queries.

Two kinds of name, two rule sets, one containment test:

- ``name_problem``: a name the pack will *create* (``filename_prefix``, the train node's ``name`` and
  ``resume_from``), or a relative path under one of the pack's folders. Portable, so a graph made on one
  system runs on another and reads the same in every file list: text only (no lone UTF-16 surrogate), no
  control character (C0 and C1: NUL, newlines, U+0085 ...), no invisible or direction-changing format
  character (zero-width U+200B..U+200D, U+2060, U+FEFF, bidi controls U+202A..U+202E, U+2066..U+2069,
  U+2028/U+2029), no absolute path or drive, no ``..`` or ``.`` part, no characters Windows refuses, no
  Windows device name (CON, PRN, AUX, NUL, COM1-9, LPT1-9, any case, with or without an extension), no part
  ending in a dot or space (Windows drops them), and every part short enough to leave room for the counter
  and suffix the pack appends (255-byte limit). Returns ``None`` or a phrase ``"<what is wrong>; <fix>"`` that
  callers prefix with the node and input; it never raises, whatever the value's type, because it runs
  inside ComfyUI's validation, where a raised error would hide the message.
- ``find_model_file``: the name of a safetensors file that *exists* in one of ComfyUI's model folders, as
  the browser asks for it (``GET <route>?name=...``). Any name the loader could list, so the portability
  rules above do not apply; but never absolute, never ``..``, and never through a symlink that leaves its
  folder. Refused with ``QueryRefused``, which carries the HTTP status to answer with; a ``FileRoute``
  turns that into the JSON the route sends (``{"error": ...}`` with the status).
- ``inside(root, path)``: whether ``path``, symlinks resolved, stays in ``root``. Both rule sets check the
  text first (so a refused name never touches the file system) and then this, because a name that is
  clean as text can still leave the folder through a symlink.

No ComfyUI here but in ``FileRoute.register``: the routes' tests call the rest directly.
"""
from __future__ import annotations

import asyncio
import logging
import ntpath
import os
import re
import unicodedata
from collections.abc import Callable, Mapping

from ..host import errors

log = logging.getLogger(__name__)

# Longest part of a created name, in UTF-8 bytes: file systems allow 255, and the pack appends counters
# and suffixes such as "_00001_.safetensors" or "_step000001_1.trainstate" (≤ 25 bytes).
MAX_NAME_PART_BYTES = 200
MAX_NAME_PARTS = 16
# Longest name a route accepts: real names are far shorter; this only bounds the work a request causes.
MAX_QUERY_NAME = 1024
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
_WINDOWS_BAD = '<>:"|?*'
# Unicode categories no created name may hold: controls (C0 and C1), format characters (zero-width, bidi),
# line and paragraph separators, surrogates.
_REFUSED_CATEGORIES = {"Cc": "control", "Cf": "invisible formatting", "Zl": "line separator",
                       "Zp": "paragraph separator", "Cs": "lone UTF-16 surrogate"}
_WINDOWS_DEVICES = re.compile(r"(CON|PRN|AUX|NUL|COM[1-9\u00b9\u00b2\u00b3]|LPT[1-9\u00b9\u00b2\u00b3])(\..*)?",
                              re.IGNORECASE)


def _parts(name: str) -> list[str]:
    """The path parts of ``name`` with either separator (names travel between Windows and POSIX)."""
    return name.replace("\\", "/").split("/")


def _absolute(name: str) -> bool:
    """A POSIX root, a Windows drive (``C:x`` too: drive-relative) or a UNC share, with either separator."""
    norm = name.replace("\\", "/")
    return norm.startswith("/") or bool(ntpath.splitdrive(norm)[0])


def inside(root: str, path: str) -> bool:
    """True when ``path`` with its symlinks resolved is ``root`` (resolved) or below it."""
    real_root = os.path.realpath(root)
    try:
        return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root
    except ValueError:  # different drives on Windows
        return False


# ---- names the pack creates -----------------------------------------------------------------------------

def _character_problem(value: str) -> str | None:
    """The first character no file name should hold, described with its code point and fix, or None."""
    for c in value:
        kind = _REFUSED_CATEGORIES.get(unicodedata.category(c))
        if kind is not None:
            what = unicodedata.name(c, "") if kind != "lone UTF-16 surrogate" else ""
            named = f"U+{ord(c):04X}{' ' + what if what else ''}"
            return (f"contains the {kind} character {c!r} ({named}), which file names must not hold (newlines, "
                    f"NUL, invisible and direction-changing characters); remove it or retype the name")
    return None


def _part_problem(part: str) -> str | None:
    """Why one path part cannot be a file or folder name on every system, or None."""
    if part and set(part) == {"."}:
        return f"has the part {part!r}, which names a folder, not a file; give a name such as 'my_lora'"
    if part.endswith((".", " ")):
        return (f"has the part {part!r} ending in a dot or space, which Windows drops (another name on another "
                "system); remove the trailing dot or space")
    if _WINDOWS_DEVICES.fullmatch(part.strip()):
        return (f"has the part {part!r}, a Windows device name (CON, PRN, AUX, NUL, COM1-9, LPT1-9) that no file "
                "can have on Windows; use another name, e.g. add a letter")
    return None


def name_problem(value: object, *, subfolders: bool, empty_ok: bool = False) -> str | None:
    """Why ``value`` is not a safe file name (or relative path when ``subfolders``), or None.

    ``empty_ok``: an empty string means "none" for this input (e.g. resume_from).
    """
    example = "'my_lora' or 'sub/my_lora'" if subfolders else "'my_lora'"
    if not isinstance(value, str):
        return f"is not text (got {type(value).__name__}); give a name such as {example}"
    character = _character_problem(value)
    if character:
        return character
    norm = value.replace("\\", "/").strip()
    if not norm:
        return None if empty_ok else f"is empty; give a name such as {example}"
    if _absolute(norm):
        return f"is an absolute path; give a name relative to the pack's folder, such as {example}"
    parts = _parts(norm)
    if ".." in parts:
        return "contains '..' and would leave the pack's folder; remove the '..'"
    if not subfolders and len(parts) > 1:
        return f"must be a plain file name without '/' or '\\'; give a name such as {example}"
    bad = sorted({c for c in norm if c in _WINDOWS_BAD})
    if bad:
        return f"contains {''.join(bad)!r}, which file names cannot hold on Windows; remove them"
    if norm.endswith("/"):
        return f"ends with a folder separator and has no file name; give a name such as {example}"
    if len(parts) > MAX_NAME_PARTS:
        return f"has {len(parts)} folder levels; use at most {MAX_NAME_PARTS}"
    part = next((p for p in map(_part_problem, _parts(value.replace("\\", "/").lstrip())) if p), None)
    if part:
        return part
    longest = max(len(p.encode("utf-8")) for p in parts)
    if longest > MAX_NAME_PART_BYTES:
        return (f"has a part of {longest} bytes; file names are limited to 255 bytes with the pack's counter and "
                f"suffix, so keep each part under {MAX_NAME_PART_BYTES}")
    return None


# ---- names of existing files the browser asks about -----------------------------------------------------

class QueryRefused(ValueError):
    """A route's query refused: a bad name (400/403), no such file (404), an unreadable file (422).
    ``status`` is the HTTP status the route answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _query_problem(name: object) -> tuple[int, str] | None:
    """(status, reason) when ``name`` cannot name a file in a model folder, judged as text alone."""
    if not isinstance(name, str) or not name.strip():
        return 400, "query parameter 'name' is required"
    if len(name) > MAX_QUERY_NAME:
        return 400, f"name longer than {MAX_QUERY_NAME} characters"
    if "\x00" in name:
        return 400, "name contains a NUL character"
    # A leading "~" reads as the home folder: refused like an absolute path, whatever the file system does.
    if _absolute(name) or name.startswith("~"):
        return 403, "absolute paths are refused; give the name as the loader lists it"
    parts = _parts(name)
    if ".." in parts:
        return 403, "'..' is refused; give the name as the loader lists it"
    if "" in parts:
        return 400, "empty path component in name"
    if not name.lower().endswith(SAFETENSORS_SUFFIXES):
        return 400, "only safetensors files (.safetensors, .sft) can be read"
    return None


def find_model_file(name: object, roots: list[str], folder: str, what: str) -> str:
    """Real path of the safetensors file called ``name`` in one of ``roots`` (the ``folder`` folders, in order).

    ``what`` names the route in messages (``"<what>: ..."``). Raises QueryRefused: 400 for
    an empty, over-long or non-safetensors name, 403 for an absolute path, a ``..`` part or a name whose
    real path leaves the root it was found in, 404 when no root holds such a file. A candidate that leaves
    its root is refused, not skipped, so a symlink cannot be used to probe other folders.
    """
    problem = _query_problem(name)
    if problem is not None:
        raise QueryRefused(problem[0], f"{what}: {problem[1]}")
    rel = os.path.join(*_parts(name))
    for root in roots:
        candidate = os.path.join(root, rel)
        if not os.path.isdir(root) or not os.path.lexists(candidate):
            continue
        if not inside(root, candidate):
            raise QueryRefused(403, f"{what}: name resolves outside the {folder} folders (symlink)")
        if os.path.isfile(candidate):
            return os.path.realpath(candidate)
    raise QueryRefused(404, f"{what}: no file named '{name}' in the {folder} folders")


class FileRoute:
    """``GET <route>?name=<file in the folder's model folders>``, answered with ``{"name", **read(path)}``
    for the file found, else ``{"error"}`` with QueryRefused's status. ``read`` raises QueryRefused(422)
    for a file it cannot read; ``what`` names the route in messages."""

    def __init__(self, route: str, folder: str, what: str, read: Callable[[str], Mapping[str, object]]) -> None:
        self.route, self.folder, self.what, self.read = route, folder, what, read
        self.registered = False

    def lookup(self, name: object, roots: list[str]) -> tuple[int, dict[str, object]]:
        """(status, JSON body) of one request: the whole route without HTTP, for tests and the handler."""
        try:
            body = self.read(find_model_file(name, roots, self.folder, self.what))
        except QueryRefused as e:
            if e.status >= 422:
                log.warning("%s", e)
            return e.status, {"error": errors.prefixed(str(e))}  # the route's boundary: the pack's one prefix
        return 200, {"name": name, **body}

    def register(self) -> None:
        """Add the route to ComfyUI's server once (idempotent). The only method here that needs ComfyUI."""
        if self.registered:
            return
        import folder_paths
        from server import PromptServer

        PromptServer.instance.routes.get(self.route)(handler(lambda: folder_paths.get_folder_paths(self.folder),
                                                             self.lookup))
        self.registered = True
        log.info("route %s registered", self.route)


def handler(get_roots: Callable[[], list[str]], lookup: Callable[[object, list[str]], tuple[int, dict]]):
    """An aiohttp GET handler answering ``lookup(<query's name>, get_roots())`` (roots read per request,
    so folders added while the server runs are seen)."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        name = request.rel_url.query.get("name")
        # The file is opened in a thread: a slow disk must not stall the server's event loop.
        status, body = await asyncio.to_thread(lookup, name, list(get_roots()))
        return web.json_response(body, status=status)

    return handle
