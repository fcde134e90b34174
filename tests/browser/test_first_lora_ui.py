"""README.md's "Your first LoRA", followed step by step in the page, on the stand-ins.

The steps are read from the README itself (nothing of them is repeated here), and each is done as it says:

1. every model file it names is put, under the name it gives, into the folder it gives (the stand-ins of
   tests/real_arch.py --t5, linked: a tiny Flux.1-dev with Flux.1's text widths, CLIP-L, T5-XXL and the Flux VAE at
   their real sizes, chosen by the file's name, flux1*, clip_l*, t5xxl*, ae*, never by its folder);
2. the dataset folder it names is made under input/ with an image and its .txt caption beside it;
3. the workflow it names is dropped on the page;
4. on each node it names (by the title the page shows; "A / B": A in ComfyUI 0.33, B in older ones) each name it
   gives is picked from that node's list: a name the node does not list (a file in a wrong folder, a node renamed)
   fails here;
5. Run: the README's step count, optimizer, learning rate and checkpoint interval must be the workflow's; a
   checkpoint lands where it says (as the name it says resume_from takes);
6. the LoRA, its training state and the learning curve land where it says (the counter in its names is any);
7. the inference workflow it names is dropped, the same names picked, the LoRA just saved picked in Load LoRA, a
   prompt written in CLIP Text Encode, Run: the image lands where it says.

Step 3's other way, *Workflow -> Browse Templates*, has its own (fast) test: the template browser, the pack's folder
under its extensions, the workflow's card, and the same graph as the dropped file.

Not in the README (time on a CPU only): 12 training steps instead of 1000 with a checkpoint every 6 instead of 250,
and a 64 x 64 latent instead of 1024 x 1024. The dataset is one image: each caption costs a T5-XXL encode (~30 s on a
2-core CPU); its image and caption are real_arch's one-caption dataset, so the dataset cache (Cached Training
Dataset, cache 'use') encodes it once. Two T5-XXL encodes remain (the caption, the prompt): ~3.5 min with the T5-XXL
file's first load on the busy 2-core machine. After step 6, two more Runs of the unchanged graph must train nothing
(ComfyUI serves Train LoRA from its cache). The README's screenshots of the real workflows come from this test
(tests/browser/readme_images.py).
"""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
from PIL import Image
from real_workflow_page import api, assert_queues, drop, number, run

from precision_browser import CLEAR_TOASTS, GRAPH_LOADED, BrowserError, fit_view
from test_training_ui import CHART_STATE, _cached_nodes, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402
from real_workflow_lib import write_files  # noqa: E402

STEPS, CHECKPOINT_EVERY, LATENT = 12, 6, 64  # not README steps: CPU time only


# -- the README ------------------------------------------------------------------------------------------------
def readme_steps(text: str | None = None) -> dict[int, str]:
    """{n: text of step n} of README.md's '## Your first LoRA' section (a step's lines joined)."""
    if text is None:
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            text = f.read()
    section = re.search(r"^## Your first LoRA\s*$(.*?)^## ", text, re.M | re.S)
    assert section, "README.md has no '## Your first LoRA' section"
    steps = re.split(r"^(\d+)\. ", section.group(1), flags=re.M)
    return {int(n): " ".join(body.split("\n\n")[0].split()) for n, body in zip(steps[1::2], steps[2::2])}


def code(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def files_by_folder(step: str) -> dict[str, str]:
    """{file: folder} of a step that says "<files> in <folder>, <files> in <folder>": each file goes into the next
    folder named after it."""
    out, pending = {}, []
    for span in code(step):
        if span.endswith(".safetensors"):
            pending.append(span)
        elif "models/" in span:
            out.update({f: span for f in pending})
            pending = []
    assert out and not pending, f"README step 1 names files without a folder after them: {pending or step}"
    return out


def picks_of(step: str) -> dict[str, list[str]]:
    """{node title: [names to pick]} of a step "...: Title: `a`, `b`; Title: `c`"."""
    body = step.split("):", 1)[1]  # after "**Pick the names** (nothing to add or wire)"
    out = {}
    for part in body.split(";"):
        title = re.split(r"`", part, maxsplit=1)[0].strip().rstrip(":").strip()
        out[title] = code(part)
    return out


def one(spans: list[str], pattern: str, step: int) -> str:
    found = [s for s in spans if re.search(pattern, s)]
    assert len(found) == 1, f"README step {step}: want one code span like /{pattern}/, got {found}"
    return found[0]


def on_disk(base: str, readme_path: str) -> str:
    """A README path (ComfyUI/models/..., models/..., output/..., input/...) in the session server's base."""
    return os.path.join(base, readme_path.removeprefix("ComfyUI/").rstrip("/"))


def like(readme_name: str) -> re.Pattern:
    """The README's example file name with each number as any number of the same width (counters, steps)."""
    return re.compile(re.sub(r"\d+", lambda m: r"\d{%d}" % len(m.group()), re.escape(readme_name)))


def new_files(folder: str, pattern: re.Pattern, before: set[str]) -> list[str]:
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(n for n in names if pattern.fullmatch(n) and n not in before)


def listing(folder: str) -> set[str]:
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


# -- the page --------------------------------------------------------------------------------------------------
# The node the page shows with one of these titles (exactly one node).
NODE_TITLED = """(titles) => {
  const nodes = window.comfyAPI.app.app.graph.nodes.filter((n) => titles.includes(n.title));
  return nodes.length === 1 ? Number(nodes[0].id) : { found: nodes.length,
    titles: window.comfyAPI.app.app.graph.nodes.map((n) => n.title) };
}"""

# One pick as a user makes it: the value in the first list of the node's widgets that offers it and that no earlier
# name of the same step went into (DualCLIPLoader's two lists both offer every text encoder).
PICK_NAME = """([id, value, used]) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  const lists = {};
  for (const w of node.widgets || []) {
    const values = typeof w.options?.values === "function" ? w.options.values() : w.options?.values;
    if (Array.isArray(values)) lists[w.name] = values;
  }
  const offering = Object.keys(lists).filter((name) => lists[name].includes(value) && !(used || []).includes(name));
  if (!offering.length) return { refused: value, lists };
  const w = node.widgets.find((x) => x.name === offering[0]);
  w.value = value;
  w.callback?.(value);
  return { widget: w.name, value: w.value };
}"""


def node_titled(page, title: str, step: int) -> int:
    """The node of a README title: "A / B" names a node titled A (ComfyUI 0.33) or B (older ComfyUI)."""
    found = page.evaluate(NODE_TITLED, title.split(" / "))
    assert isinstance(found, int), f"README step {step} names the node '{title}': the page shows {found}"
    return found


def pick_names(page, picks: dict[str, list[str]], step: int, only_present: bool = False) -> dict[str, dict]:
    """Picks each README name on the node of its title; {title: {widget: value}} (titles the page lacks are
    left out with `only_present`, for the inference graph's "the same names")."""
    done = {}
    shown = set(page.evaluate("() => window.comfyAPI.app.app.graph.nodes.map((n) => n.title)"))
    for title, names in picks.items():
        if only_present and not shown & set(title.split(" / ")):
            continue
        node = node_titled(page, title, step)
        done[title] = {}
        for name in names:
            got = page.evaluate(PICK_NAME, [node, name, list(done[title])])
            assert "refused" not in got, f"README step {step}: {title} does not offer `{name}`: {got['lists']}"
            done[title][got["widget"]] = got["value"]
    return done


def with_picks(prompt: dict, ids_by_title: dict[str, int], done: dict[str, dict]) -> dict:
    """The API twin with the README's picks on the nodes they were made on."""
    for title, widgets in done.items():
        prompt[str(ids_by_title[title])]["inputs"].update(widgets)
    return prompt


# -- the stand-ins ---------------------------------------------------------------------------------------------
STANDINS = (("flux1", "diffusion_models", real_arch.TINY_FLUX_T5_NAME),
            ("clip_l", "text_encoders", real_arch.CLIP_L_NAME), ("t5xxl", "text_encoders", real_arch.T5_NAME),
            ("ae", "vae", real_arch.VAE_NAME))


def standin_for(name: str, base: str) -> str:
    """The stand-in for a README model file, by what its name says it is (not by the folder the README gives it:
    a wrong folder must show in the page, as it would for a user)."""
    found = [os.path.join(base, "models", sub, file) for prefix, sub, file in STANDINS if name.startswith(prefix)]
    assert len(found) == 1, f"no stand-in for the README's model file {name}"
    return os.path.realpath(found[0])


@pytest.fixture(scope="module")
def followed(comfy_server):
    """Steps 1 and 2 done in the session server's base (stand-ins linked under the README's names and folders, the
    dataset folder written); removed afterwards, and the server's models unloaded (T5-XXL holds ~10 GB)."""
    base = write_files(comfy_server, "real_arch.py", args=("--t5",))
    steps = readme_steps()
    made = []
    for name, folder in files_by_folder(steps[1]).items():
        path = os.path.join(on_disk(base, folder), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.lexists(path):
            os.symlink(standin_for(name, base), path)
            made.append(path)
    dataset = one(code(steps[2]), r"^(ComfyUI/)?input/[^/]+/?$", 2)
    folder = on_disk(base, dataset)
    assert re.search(r"\.txt\b", steps[2]) and "caption" in steps[2], steps[2]  # captions beside the images
    real_arch.write_dataset(folder, count=1)
    made.append(folder)
    yield base, steps
    for path in made:
        if os.path.isdir(path) and not os.path.islink(path):
            for f in os.listdir(path):
                os.remove(os.path.join(path, f))
            os.rmdir(path)
        else:
            os.remove(path)
    comfy_server.request("/free", {"unload_models": True, "free_memory": True})


def run_again_trains_nothing(page, server) -> None:
    """Two more Runs of the unchanged graph train nothing: ComfyUI serves Train LoRA from its cache (the pack's seeds
    are fixed), and the chart still shows the finished run."""
    train_id = str(page.evaluate(NODE_OF_TYPE, "PrecisionTrainLoRA"))
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({train_id}); return s && s.done ? s : false; }}",
                          timeout=60)
    assert chart["points"] >= STEPS - 2, chart
    again = [_run_from_page(page, server) for _ in range(2)]
    assert all(r["status"]["status_str"] == "success" for r in again), [r["status"] for r in again]
    assert all(train_id in _cached_nodes(r) for r in again), [sorted(_cached_nodes(r)) for r in again]


# The id of the graph's one node of a type.
NODE_OF_TYPE = """(type) => {
  const found = (window.app.graph._nodes || window.app.graph.nodes).filter((n) => n.type === type);
  return found.length === 1 ? found[0].id : null;
}"""


def train_as_steps_3_to_6(page, server, base: str, steps: dict[int, str], picks: dict[str, list[str]]) -> str:
    """Drops the README's workflow, picks its names, runs it; checks what lands where steps 5 and 6 say. Returns the
    LoRA's name in Load LoRA's list."""
    name = os.path.basename(one(code(steps[3]), r"^workflows/[^/]+\.json$", 3))
    types = drop(page, name, no_overlaps=False)
    done = pick_names(page, picks, 4)
    want = with_picks(api(name), {t: node_titled(page, t, 4) for t in done}, done)
    # what step 5 says the workflow does, then the CPU-time cuts (not README steps)
    facts = re.search(r"(\d+) steps, (\w+) ([\d.e-]+);.* Every (\d+) steps a checkpoint", steps[5])
    assert facts, steps[5]
    train = want[str(types["PrecisionTrainLoRA"])]["inputs"]
    settings = want[str(types["PrecisionTrainSettings"])]["inputs"]
    assert (train["steps"], settings["optimizer"], settings["learning_rate"], settings["checkpoint_every"]) == (
        int(facts.group(1)), facts.group(2).lower(), float(facts.group(3)), int(facts.group(4))), steps[5]
    number(page, [(types["PrecisionTrainLoRA"], "steps", STEPS),
                  (types["PrecisionTrainSettings"], "checkpoint_every", CHECKPOINT_EVERY)])
    train["steps"], settings["checkpoint_every"] = STEPS, CHECKPOINT_EVERY
    assert_queues(page, want)  # nothing to add or wire: the README's picks are the only changes
    fit_view(page)
    page.screenshot("first_lora_01_names_picked")

    curve = one(code(steps[6]), r"^(ComfyUI/)?output/.+\.png$", 6)
    watched = {what: (on_disk(base, os.path.dirname(p)), like(os.path.basename(p))) for what, p in (
        ("checkpoint", one(code(steps[5]), r"^models/loras/.+_step\d+\.safetensors$", 5)),
        ("LoRA", one(code(steps[6]), r"models/loras/.+\.safetensors$", 6)),
        ("learning curve", curve), ("learning curve's csv", curve.removesuffix(".png") + ".csv"))}
    before = {what: listing(folder) for what, (folder, _) in watched.items()}
    run(page, server, timeout=1800)
    landed = {what: new_files(folder, pattern, before[what]) for what, (folder, pattern) in watched.items()}
    wrong = {what: (watched[what][0], watched[what][1].pattern, new) for what, new in landed.items()
             if len(new) != (STEPS // CHECKPOINT_EVERY if what == "checkpoint" else 1)}
    assert not wrong, f"not where README steps 5 and 6 say (folder, name, new files there): {wrong}"
    loras = on_disk(base, "models/loras")
    resume = one(code(steps[5]), r"^resume_from=", 5).split("=", 1)[1]
    first_checkpoint = os.path.relpath(os.path.join(watched["checkpoint"][0], landed["checkpoint"][0]), loras)
    assert like(resume).fullmatch(first_checkpoint), (resume, first_checkpoint)
    lora = os.path.join(watched["LoRA"][0], landed["LoRA"][0])
    state = one(code(steps[6]), r"\.trainstate$", 6)
    beside = lora.removesuffix(".safetensors") + ".trainstate"
    assert like(state).fullmatch(os.path.basename(beside)) and os.path.isfile(beside), ("step 6", state, beside)
    fit_view(page)
    page.screenshot("first_lora_02_trained")
    return os.path.relpath(lora, loras)


def infer_as_step_7(page, server, base: str, steps: dict[int, str], picks: dict[str, list[str]], lora_name: str):
    """Drops the README's inference workflow, picks the same names, the LoRA and a prompt on the nodes it names,
    runs it; the image lands where it says."""
    name = os.path.basename(one(code(steps[7]), r"^workflows/[^/]+\.json$", 7))
    nodes = re.search(r"same model, text encoders and VAE and the LoRA `([^`]+)` in (.+?), write your prompt in (.+?) "
                      r"and Run", steps[7])
    assert nodes, steps[7]
    named_lora, loader_title, prompt_title = nodes.groups()
    assert like(named_lora).fullmatch(lora_name), (named_lora, lora_name)
    image = one(code(steps[7]), r"^(ComfyUI/)?output/.+\.png$", 7)
    types = drop(page, name, no_overlaps=False)
    done = pick_names(page, picks, 7, only_present=True)
    assert len(done) == 3, done  # model, text encoders, VAE
    done[loader_title] = {"lora_name": lora_name}
    ids = {t: node_titled(page, t, 7) for t in done}
    assert page.evaluate(PICK_NAME, [ids[loader_title], lora_name, []]) == {"widget": "lora_name", "value": lora_name}
    prompt = "a photo of sks, a red square"  # the dataset's caption, trigger word included
    encoder, latent = node_titled(page, prompt_title, 7), types["EmptySD3LatentImage"]
    number(page, [(encoder, "text", prompt)] + [(latent, side, LATENT) for side in ("width", "height")])
    want = with_picks(api(name), ids, done)
    want[str(encoder)]["inputs"]["text"] = prompt
    want[str(latent)]["inputs"].update(width=LATENT, height=LATENT)  # not a README step: CPU time
    assert_queues(page, want)
    folder, pattern = on_disk(base, os.path.dirname(image)), like(os.path.basename(image))
    before = listing(folder)
    entry = run(page, server, timeout=1800)
    new = new_files(folder, pattern, before)
    assert len(new) == 1, ("step 7: the image", folder, pattern.pattern, new, entry["outputs"])
    pixels = np.asarray(Image.open(os.path.join(folder, new[0])))
    assert pixels.shape == (LATENT, LATENT, 3) and pixels.std() > 0, pixels.shape
    fit_view(page)
    page.screenshot("first_lora_03_image")


PACK_FOLDER = "comfyui-precision-lora"  # how ComfyUI names the pack's templates: its folder in custom_nodes/


# The template cards the browser shows (their names), once they are exactly the ones wanted.
CARDS = """(want) => {
  const shown = [...document.querySelectorAll('[data-testid^="template-workflow-"]')]
    .map((e) => e.dataset.testid.slice("template-workflow-".length)).sort();
  return JSON.stringify(shown) === JSON.stringify(want) ? shown : false;
}"""


def test_step_3_the_workflow_from_browse_templates(comfy_page, comfy_server):
    """README step 3's "or open it from Workflow -> Browse Templates": the menu item's command opens the frontend's
    template browser; there the pack's folder (under its extensions) is clicked, which shows every workflow the
    server serves for the pack, then the workflow's card, and the graph that opens is the shipped file's, queueing
    its API twin."""
    page, steps = comfy_page, readme_steps()
    served = sorted(comfy_server.get("/api/workflow_templates")[1][PACK_FOLDER])
    assert "Browse Templates" in steps[3], steps[3]
    name = os.path.basename(one(code(steps[3]), r"^workflows/[^/]+\.json$", 3))
    card = name.removesuffix(".json")
    page.evaluate(CLEAR_TOASTS)
    page.evaluate("() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    page.call("click", selector=f'text="{PACK_FOLDER}"')  # playwright waits for it (10 s)
    try:
        shown = page.wait_for(CARDS, served, timeout=15)
    except BrowserError:
        shown = page.evaluate(CARDS.replace("JSON.stringify(shown) === JSON.stringify(want) ? shown : false", "shown"))
        pytest.fail(f"Browse Templates -> {PACK_FOLDER} shows {shown}, the server serves {served}")
    assert card in shown, f"Browse Templates -> {PACK_FOLDER} has no card '{card}' (README step 3): {shown}"
    page.call("click", selector=f'[data-testid="template-workflow-{card}"]')
    with open(os.path.join(ROOT, "workflows", name)) as f:
        want_ids = sorted(n["id"] for n in json.load(f)["nodes"])
    state = page.wait_for(GRAPH_LOADED, want_ids, timeout=60)
    assert state["missingNodes"] == [] and state["unregistered"] == [] and state["toasts"] == [], state
    assert_queues(page, api(name))
    assert page.pack_errors() == []
