"""The text side of a model family: `VLProcessor` turns samples (problem text and images) into a left-padded
`PromptBatch`, and `ImageCache` (vlmrl.models.image_cache) keeps each image's processed tensors.

A family subclasses `VLProcessor` and overrides what differs: the chat template used when the tokenizer has none, the
image marker the template writes and the placeholder span that replaces it (`placeholders`), the image tensors
(`process_images`), the pixel budget. Everything else — chat rendering, placeholder expansion, tokenisation with left
padding, the no-truncation rule and the image-token count check — is shared here, so generation and the training
forward see one preprocessing path. The model side is `VLFamily` (vlmrl.models.families.base).
"""

from __future__ import annotations

import copy
import json
import re
import sys
import threading
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vlmrl.cache import BoundedLRU
from vlmrl.errors import ConfigError, DataError, PathError
from vlmrl.models.batch import PromptBatch, PromptTooLongError
from vlmrl.models.image_cache import ImageCache

PROCESSOR_FILE = "vlmrl_processor.json"
# Text a client sent (the server's messages) travels through the chat template between these two private-use
# characters (`client_text`), so that tokenising splits the special tokens in it: only the template makes special
# tokens. `_SLOT` stands in for a client span while image markers are expanded in the text around it.
CLIENT_OPEN, CLIENT_CLOSE, _SLOT = "\ue000", "\ue001", "\ue002"
_LITERAL_LOCK = threading.Lock()  # `VLProcessor.literal_tokenizer` is made once
_CLIENT_SPAN = re.compile("\ue000(.*?)\ue001", re.S)


def client_text(text: str) -> str:
    """`text` marked as a client's: tokenised with special tokens split (`<|im_end|>` in it is text, never a turn
    boundary; `<|image_pad|>` never an image slot). A text holding the marking characters or a lone surrogate (which
    no tokenizer encodes) is a ValueError."""
    if CLIENT_OPEN in text or CLIENT_CLOSE in text or _SLOT in text:
        raise ValueError("the text holds U+E000, U+E001 or U+E002, private-use characters this server reserves")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return CLIENT_OPEN + text + CLIENT_CLOSE
TOKEN_CACHE_BYTES = 32 * 2**20  # `VLProcessor.token_rows`: the quickstart's 1,024 remembered prompts take ~6 MB
TOKEN_CACHE_ENTRIES = 1024  # and `VLProcessor.prompt_texts`
PROMPT_CACHE_BYTES = 16 * 2**20  # `VLProcessor.prompt_texts`: a rendered prompt per distinct question


def _token_row_bytes(text: str, ids: array) -> int:
    """What one remembered tokenisation holds: the text object and its ids (8 bytes each in an array)."""
    return sys.getsizeof(text) + ids.itemsize * len(ids)


def _prompt_text_bytes(key: tuple, text: str) -> int:
    """A rendered prompt and its question (the system prompt and template in the key are shared, not copies)."""
    return sys.getsizeof(key[0]) + sys.getsizeof(text)


@dataclass
class ImageInputs:
    """What a family's image processor makes of a flat list of images."""

    vision: dict[str, Tensor]  # tensors stacked over images (see PromptBatch.vision)
    vision_rows: dict[str, list[int]]  # rows of each image in each tensor
    placeholders: list[str]  # the text that replaces each image's marker
    tokens: list[int]  # placeholder tokens (= feature vectors) of each image
    keys: list[int | None] = field(default_factory=list)  # see `ImageCache.serials`; None: not cached


def read_chat_template(path: str | Path) -> str | None:
    """The processor chat template shipped with a checkpoint (chat_template.jinja or chat_template.json, in a folder or
    a hub repository), if any: VLM repositories keep their image-aware template there, not in the tokenizer."""
    from transformers.utils import cached_file

    for name in ("chat_template.jinja", "chat_template.json"):
        file = cached_file(str(path), name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
        if file:
            text = Path(file).read_text()
            return json.loads(text).get("chat_template") if name.endswith(".json") else text
    return None


def saved_system_prompt(path: str | Path) -> str | None:
    """The system prompt saved in a checkpoint's vlmrl_processor.json (an agentic run's tool descriptions), or None
    (no file: a hub model; or a checkpoint trained without one)."""
    from transformers.utils import cached_file

    file = cached_file(str(path), PROCESSOR_FILE, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)
    if not file:
        return None
    try:
        prompt = json.loads(Path(file).read_text()).get("system_prompt")
    except (OSError, ValueError, AttributeError) as exc:
        raise PathError(f"{file}: not a readable {PROCESSOR_FILE} ({exc}); save the checkpoint again or delete "
                        "the file") from None
    if prompt is not None and not isinstance(prompt, str):
        raise PathError(f"{file}: system_prompt is a {type(prompt).__name__}, expected a string or null")
    return prompt


def added_bos_id(tokenizer) -> int | None:
    """The BOS id `tokenizer` puts in front of the text it encodes with special tokens (`add_bos_token`, or a
    post-processor template such as Llama's "<s> $A"), or None when it adds none (Qwen; tokenizers without a BOS)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_special = tokenizer("x")["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None


class VLProcessor:
    """Tokenizer + image processor of one family: samples in, a left-padded `PromptBatch` out."""

    family = ""  # registry name, written to vlmrl_processor.json
    image_marker = ""  # what the chat template writes for one image
    image_token = ""  # the placeholder token whose embeddings image features replace
    end_tokens: tuple[str, ...] = ()  # end-of-turn tokens; generation stops at them (the first one ends SFT targets)
    builtin_template = ""  # used when neither the tokenizer nor the checkpoint folder has a chat template
    image_processor_class = ""  # a transformers image processor that needs no torchvision

    def __init__(self, tokenizer, image_processor, system_prompt: str | None = None, config=None,
                 chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.system_prompt = system_prompt
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or self.builtin_template
        if self.image_token not in tokenizer.get_vocab():
            raise PathError(f"the tokenizer has no {self.image_token!r} token, which the {self.family} family puts "
                             f"where image features go: is this the tokenizer of a {self.family} model?")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.prompt_bos_id = added_bos_id(tokenizer)  # None: prompts get no BOS from vlmrl
        if config is None and type(self).options_from_config is not VLProcessor.options_from_config:
            raise ValueError(f"{type(self).__name__} needs the model config (config=...) for its placeholder counts")
        self.options = self.options_from_config(config) if config is not None else {}
        self.image_cache = ImageCache()
        self.prompt_texts: BoundedLRU[tuple, str] = BoundedLRU(PROMPT_CACHE_BYTES, TOKEN_CACHE_ENTRIES,
                                                               _prompt_text_bytes)  # see `prompt_text`
        self.token_rows: BoundedLRU[str, array] = BoundedLRU(TOKEN_CACHE_BYTES, TOKEN_CACHE_ENTRIES,
                                                             _token_row_bytes)  # see `tokenize`
        self._max_token_chars: int | None = None  # see `max_prompt_chars`

    # -- construction and saving ---------------------------------------------------------------------------------
    def options_from_config(self, config) -> dict:
        """Model-config values the placeholder expansion needs (e.g. tokens per image); saved with the processor."""
        return {}

    @classmethod
    def from_pretrained(cls, path: str | Path, config=None, **kwargs) -> VLProcessor:
        import transformers
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        image_processor = getattr(transformers, cls.image_processor_class).from_pretrained(path, **kwargs)
        if config is None:
            config = AutoConfig.from_pretrained(path, **kwargs)
        return cls(tokenizer, image_processor, system_prompt=saved_system_prompt(path), config=config,
                   chat_template=read_chat_template(path))

    def save_pretrained(self, path: str | Path) -> None:
        """Tokenizer, image processor, chat template and `vlmrl_processor.json`: the family, its options and the
        system prompt (an agentic run's tool descriptions), so a loaded checkpoint prompts as its training did."""
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        (Path(path) / "chat_template.jinja").write_text(self.chat_template)  # ours, over any text-only template
        (Path(path) / PROCESSOR_FILE).write_text(json.dumps({"family": self.family, "options": self.options,
                                                             "system_prompt": self.system_prompt}))

    def set_pixel_budget(self, min_pixels: int | None, max_pixels: int | None) -> None:
        """Apply model.min_pixels / model.max_pixels; the same processor feeds generation and training."""
        if min_pixels or max_pixels:
            raise ConfigError(f"model.min_pixels/model.max_pixels: the {self.family} family resizes images to a fixed "
                             f"size and has no pixel budget; remove these keys")

    def max_image_pixels(self) -> int | None:
        """The pixel budget an image is processed at (None: the family resizes every image to a fixed size)."""
        return None

    def fit_pixels(self) -> int | None:
        """About the most pixels an image ends up with: the pixel budget, else the family's fixed size (from the
        image processor's `size`). A server decodes large images toward it (vlmrl.serve.images); None: unknown."""
        budget = self.max_image_pixels()
        if budget:
            return int(budget)
        size = dict(getattr(self.image_processor, "size", None) or {})
        if "height" in size and "width" in size:
            return int(size["height"]) * int(size["width"])
        edge = size.get("longest_edge") or size.get("shortest_edge")
        return int(edge) ** 2 if edge else None

    # -- the text side ---------------------------------------------------------------------------------------------
    def prompt_text(self, problem: str, n_images: int) -> str:
        """The chat-formatted prompt: one user turn with the images first, then the problem; generation prompt on.
        Remembered per (problem, images, system prompt, template): a task asks few distinct questions, and the
        template's render cost ~0.2 ms per prompt, every time a prompt was drawn."""
        key = (problem, n_images, self.system_prompt, self.chat_template)
        text = self.prompt_texts.get(key)
        if text is None:
            content = [{"type": "image"}] * n_images + [{"type": "text", "text": problem}]
            text = self.chat_text([{"role": "user", "content": content}])
            self.prompt_texts.put(key, text)
        return text

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
        """A conversation (`{"role", "content": [{"type": "image"} | {"type": "text", "text"}]}` turns) rendered
        with the chat template, generation prompt on; `system_prompt` goes first when it has no system turn.
        `prompt_text` is its one-user-turn case; the server (vlmrl.serve.chat) renders whole conversations, and a
        conversation ending with an answer to score (the generation prompt off; `continue_final_message`: the last
        assistant turn left open, as transformers renders it)."""
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": [{"type": "text", "text": self.system_prompt}]}, *messages]
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message)

    def process_images(self, images: list) -> ImageInputs:
        raise NotImplementedError

    def processed_images(self, images: list) -> ImageInputs:
        """`process_images`, with each image's tensors from `image_cache` when the same image object was processed
        before (the images not cached are processed in one call). A changed pixel budget empties the cache. `keys`
        holds each image's cache serial (None for an image the cache did not keep)."""
        budget = repr([getattr(self.image_processor, k, None) for k in ("size", "max_image_size")])
        if budget != getattr(self, "_cached_budget", None):
            self.image_cache.clear()
            self._cached_budget = budget
        cached = [self.image_cache.get(im) for im in images]
        missing = [im for im, c in zip(images, cached, strict=True) if c is None]
        if missing:
            fresh = self.process_images(missing)
            splits = {k: v.split(fresh.vision_rows[k]) for k, v in fresh.vision.items()}
            it = iter(range(len(missing)))
            for i, c in enumerate(cached):
                if c is None:
                    j = next(it)
                    entry = ({k: parts[j] for k, parts in splits.items()}, fresh.placeholders[j], fresh.tokens[j],
                             next(ImageCache.serials))
                    cached[i] = entry if self.image_cache.put(images[i], entry) else (*entry[:3], None)
            if len(missing) == len(images):
                fresh.keys = [c[3] for c in cached]
                return fresh
        keys = cached[0][0].keys()
        return ImageInputs({k: torch.cat([c[0][k] for c in cached]) for k in keys},
                           {k: [len(c[0][k]) for c in cached] for k in keys},
                           [c[1] for c in cached], [c[2] for c in cached], [c[3] for c in cached])

    def expand(self, text: str, placeholders: list[str], sample_id: str) -> str:
        """Replace the i-th image marker of `text` with `placeholders[i]` (never inside a client's text, which is
        kept as it is: `client_text`)."""
        pieces = _CLIENT_SPAN.split(text)  # template, client text, template, ...
        parts = _SLOT.join(pieces[0::2]).split(self.image_marker)
        if len(parts) != len(placeholders) + 1:
            raise DataError(f"sample {sample_id!r}: the prompt holds {len(parts) - 1} image markers "
                             f"'{self.image_marker}' for {len(placeholders)} images; does the problem text contain "
                             f"'{self.image_marker}'? Remove it (images are placed by the chat template)")
        out = parts[0]
        for ph, part in zip(placeholders, parts[1:], strict=True):
            out += ph + part
        template = out.split(_SLOT)
        return "".join(t + (CLIENT_OPEN + c + CLIENT_CLOSE if k < len(pieces) // 2 else "")
                       for k, (t, c) in enumerate(zip(template, [*pieces[1::2], ""], strict=True)))

    @property
    def literal_tokenizer(self):
        """A copy of the tokenizer that splits special tokens: for text from outside (a client's, a tool's, an
        answer an RM scores), where `<|im_end|>` is text, never a turn boundary. A copy with its own backend: passing
        `split_special_tokens` to the shared tokenizer sets a flag on its Rust backend that every thread shares, so
        a prompt tokenised at the same moment (a server's other request, an asynchronous producer) lost its special
        tokens (a served request saw 0 image placeholders)."""
        literal = self.__dict__.get("_literal_tokenizer")
        if literal is None:
            with _LITERAL_LOCK:
                literal = self.__dict__.get("_literal_tokenizer")
                if literal is None:
                    literal = copy.deepcopy(self.tokenizer)
                    literal.split_special_tokens = True
                    self.__dict__["_literal_tokenizer"] = literal
        return literal

    def _token_ids(self, text: str) -> list[int]:
        """One marked text's ids: the template's pieces tokenised as usual, each client span with special tokens
        split (`client_text`)."""
        ids: list[int] = []
        for k, piece in enumerate(_CLIENT_SPAN.split(text)):
            if piece:
                ids += (self.literal_tokenizer if k % 2 else self.tokenizer)(piece, add_special_tokens=False)[
                    "input_ids"]
        return ids

    def max_prompt_chars(self, max_prompt_length: int) -> int:
        """The longest prompt text (image markers included, before expansion) that can be `max_prompt_length`
        tokens: no token stands for more characters than its own vocabulary entry has (a byte-level entry spells
        each byte with one character, a SentencePiece one each character, or 6 for a byte fallback `<0xNN>`). A
        longer text is refused before it is tokenised, which costs seconds and memory for a megabyte of text."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        return max_prompt_length * self._max_token_chars

    def tokenize(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Left-padded ids and attention mask of the expanded prompts, with the special tokens the family's own
        transformers processor gets: the tokenizer's BOS in front when the tokenizer adds one (LLaVA's Llama
        tokenizer: `<s>`) and the chat template did not already write it (Gemma 3's writes `<bos>`, as
        `ProcessorMixin.apply_chat_template` checks); nothing else (no EOS at the end of a prompt).

        Token ids are remembered per expanded text (a prompt is tokenised again every time it is drawn) in a cache
        bounded by bytes and entries (`token_rows`), so a server's unique, possibly huge prompts cannot pile up."""
        bos = self.tokenizer.bos_token
        found = {t: self.token_rows.get(t) for t in dict.fromkeys(texts)}  # (a client's text: `client_text`)
        missing = [t for t, ids in found.items() if ids is None and CLIENT_OPEN not in t]
        marked = [t for t, ids in found.items() if ids is None and CLIENT_OPEN in t]
        fresh = self.tokenizer(missing, add_special_tokens=False)["input_ids"] if missing else []
        for t, ids in [*zip(missing, fresh, strict=True), *((t, self._token_ids(t)) for t in marked)]:
            found[t] = array("q", ids)
            self.token_rows.put(t, found[t])
        rows = [list(found[t]) for t in texts]
        if self.prompt_bos_id is not None:
            rows = [([] if t.startswith(bos) else [self.prompt_bos_id]) + r for t, r in zip(texts, rows, strict=True)]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: generation appends to the right of every prompt
            if r:
                input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r):] = 1
        return input_ids, mask

    def prompt_lengths(self, problems: list[str], images: list[list], sample_ids: list[str]) -> list[int]:
        """The token count of each prompt `__call__` would build (images included), without image tensors: a
        family's placeholders depend only on each image's size, so one blank image per distinct size is processed."""
        from PIL import Image

        from vlmrl.data.images import image_sizes

        sizes = [image_sizes(ims) for ims in images]
        distinct = sorted({size for row in sizes for size in row})
        placeholders = {}
        if distinct:
            inputs = self.process_images([Image.new("RGB", size) for size in distinct])
            placeholders = dict(zip(distinct, inputs.placeholders, strict=True))
        texts = [self.expand(self.prompt_text(p, len(row)), [placeholders[size] for size in row], sid)
                 for p, row, sid in zip(problems, sizes, sample_ids, strict=True)]
        rows = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token
        return [len(r) + (self.prompt_bos_id is not None and not t.startswith(bos)) for t, r in zip(texts, rows,
                                                                                                  strict=True)]

    def __call__(self, problems: list[str], images: list[list], sample_ids: list[str],
                 max_prompt_length: int | None = None) -> PromptBatch:
        texts = [self.prompt_text(p, len(ims)) for p, ims in zip(problems, images, strict=True)]
        return self.build(texts, images, sample_ids, max_prompt_length)

    def build(self, texts: list[str], images: list[list], sample_ids: list[str],
              max_prompt_length: int | None = None) -> PromptBatch:
        """Chat-formatted `texts` (one image marker per image, from `prompt_text` or `chat_text`) and their images
        -> a PromptBatch: placeholders expanded, tokenised, length and image-token counts checked."""
        texts = list(texts)
        if max_prompt_length is not None:  # before any image or token work: a refused prompt costs nothing
            limit = self.max_prompt_chars(max_prompt_length)
            for sid, text in zip(sample_ids, texts, strict=True):
                if len(text) > limit:
                    raise PromptTooLongError(
                        f"sample {sid!r}: prompt text is {len(text)} characters, more than {max_prompt_length} "
                        f"tokens can hold (max_prompt_length={max_prompt_length}; no token of this tokenizer is "
                        f"over {limit // max_prompt_length} characters); shorten the text or raise "
                        "data.max_prompt_length")
        flat = [im for ims in images for im in ims]
        inputs = self.processed_images(flat) if flat else ImageInputs({}, {}, [], [])
        start = 0
        for i, ims in enumerate(images):
            texts[i] = self.expand(texts[i], inputs.placeholders[start:start + len(ims)], sample_ids[i])
            start += len(ims)
        input_ids, mask = self.tokenize(texts)
        if max_prompt_length is not None:
            for sid, n in zip(sample_ids, mask.sum(-1).tolist(), strict=True):
                if n > max_prompt_length:
                    # Never truncate: a cut inside an image placeholder span misaligns features and tokens.
                    raise PromptTooLongError(
                        f"sample {sid!r}: prompt is {n} tokens (images included), over max_prompt_length="
                        f"{max_prompt_length}; raise data.max_prompt_length or lower the pixel budget "
                        f"(model.max_pixels)")
        mm = (input_ids == self.image_token_id).long()
        start = 0
        for i, ims in enumerate(images):
            expected = sum(inputs.tokens[start:start + len(ims)])
            start += len(ims)
            if int(mm[i].sum()) != expected:
                raise DataError(f"sample {sample_ids[i]!r}: {int(mm[i].sum())} image placeholder tokens "
                                 f"'{self.image_token}' but its images give {expected} features: does the problem "
                                 f"text contain '{self.image_token}'?")
        return PromptBatch(list(sample_ids), input_ids, mask, mm, inputs.vision, inputs.vision_rows,
                           [len(i) for i in images], inputs.tokens, inputs.keys)
