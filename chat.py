"""Chat rendering, shared by both front ends: a conversation -> the prompt's ids (the tokenizer's chat template, image
placeholder blocks spliced in at markers), the checks a prompt text passes, the reasoning markers, and ids -> text as
they are decoded (TextStream).
"""
from dataclasses import dataclass

import image_processing
from runtime import UserError

IMAGE_MARKER = "<image>"  # where a text prompt places an image block; without markers the images lead the text
THINK = ("<think>", "</think>")  # a reasoning block's markers, when the tokenizer holds both as tokens


@dataclass
class Prompt:
    """One request as rank 0 prepared it: ids, and image inputs (a file path, a dict of prepared tensors, or None)."""
    ids: list
    images: str | dict | None = None


def not_utf8(text: str) -> int | None:
    """The position of the first character UTF-8 cannot encode, or None. Such a character is a lone surrogate: a
    JSON \\ud800 escape, or an undecodable byte of a command line or of stdin (Python's surrogateescape); the
    tokenizer refuses it."""
    try:
        text.encode()
        return None
    except UnicodeEncodeError as e:
        return e.start


def literal_image_token(text: str) -> str | None:
    """The first image token the text holds literally, or None: images go in as images, never as their tokens."""
    return next((t for t in image_processing.IMAGE_TOKENS if t in text), None)


def render(tok, messages: list, raw: bool) -> str:
    if raw:
        return "".join(m["content"] for m in messages)
    if not tok.chat_template:
        raise UserError("the tokenizer has no chat template; use --raw-prompt to tokenize plain text")
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def splice(tok, rendered: str, blocks: list, raw: bool, marker: str = IMAGE_MARKER) -> list:
    """Rendered text -> its ids, the k-th marker replaced by blocks[k] (an image's placeholder ids); the pieces between
    markers are tokenized apart, so no token spans an image."""
    pieces = rendered.split(marker)
    ids = tok(pieces[0], add_special_tokens=raw)["input_ids"]
    for block, piece in zip(blocks, pieces[1:]):
        ids += block + tok(piece, add_special_tokens=False)["input_ids"]
    return ids


def text_ids(tok, vl, text: str, images: list, where: str, raw: bool, messages: list = (),
             blocks: list = ()) -> tuple[Prompt, list]:
    """A user turn (after `messages`, earlier turns whose images have the placeholder `blocks`) -> (its prompt,
    the blocks of every image so far); each IMAGE_MARKER becomes that image's placeholder block (crops, then the
    overview), built from the tokenizer. UserError names `where`."""
    if not isinstance(text, str):
        raise UserError(f'{where}: "prompt" must be a string, got {type(text).__name__} {text!r}')
    at = not_utf8(text)
    if at is not None:
        raise UserError(f"{where}: the text is not valid UTF-8 (character {at}: {text[at]!r})")
    if tok is None:
        raise UserError(f"{where}: a text prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; "
                        "pass --tokenizer")
    if images and vl is None:
        raise UserError(f"{where}: images given but the shards hold a text-only model")
    if images and tok.convert_tokens_to_ids(image_processing.IMAGE_TOKENS[0]) != vl.image_token_id:
        raise UserError(f"the tokenizer's {image_processing.IMAGE_TOKENS[0]} id differs from the config's "
                        f"image_token_id={vl.image_token_id}")
    literal = literal_image_token(text)
    if literal:
        raise UserError(f"{where}: the text holds the image token {literal!r} literally; images go in with "
                        f"--image (or \"images\") and an {IMAGE_MARKER} marker")
    marks = text.count(IMAGE_MARKER)
    if marks and marks != len(images):
        raise UserError(f"{where}: the text holds {marks} {IMAGE_MARKER} marker(s) for {len(images)} image(s)")
    if images and not marks:  # no markers: the images come first in the user turn, in order
        text = IMAGE_MARKER * len(images) + text
    try:
        rendered = render(tok, list(messages) + [{"role": "user", "content": text}], raw)
    except UserError:
        raise
    except Exception as e:  # a template that does not compile or raises: jinja's and the tokenizer's own errors
        raise UserError(f"{where}: the tokenizer's chat template failed ({type(e).__name__}: {str(e)[:300]}); fix "
                        "chat_template in the tokenizer files, or use --raw-prompt") from None
    inputs, blocks = None, list(blocks)
    if images:
        try:
            batch = image_processing.preprocess([image_processing.load_image(f) for f in images], vl.vision)
            blocks += [image_processing.image_block_ids(tok, lay, vl.vision) for lay in batch.layouts]
        except ValueError as e:  # image_processing: an unreadable file, or a tokenizer without the image tokens
            raise UserError(f"{where}: {e}") from None
        inputs = batch.model_inputs()
    return Prompt(splice(tok, rendered, blocks, raw), inputs), blocks


def think_ids(tok) -> tuple | None:
    """(<think>, </think>) ids when the tokenizer holds both as tokens, else None (no reasoning split)."""
    ids = tuple(tok.convert_tokens_to_ids(t) for t in THINK)
    if all(isinstance(i, int) and i >= 0 and i != tok.unk_token_id for i in ids):
        return ids
    return None


class TextStream:
    """Incremental detokenization of one request: push(ids) -> the text they complete. Text that ends in an
    unfinished UTF-8 sequence (the replacement character) is held back until the next id completes it; the pieces
    concatenate to tok.decode(all ids), and flush() returns what is left."""

    def __init__(self, tok):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def push(self, ids: list) -> str:
        self.ids += ids
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
