"""`kvfid rollouts --server URL`: trajectories from any OpenAI-compatible completions server.

kvfid tokenizes the prompts itself (its codec, chat template applied) and sends the token ids as
the prompt (`POST URL/v1/completions`, `"prompt": [ids]`), so the server never re-tokenizes
them; it asks for the sampled token's logprob (`"logprobs": 0`) and for token ids back
(`"return_token_ids"` and `"return_tokens_as_token_ids"`: vLLM's fields; a server that returns
neither form is refused, exit 3). The model name is the server's first in `GET URL/v1/models`
unless given. Plain urllib: no client library.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

from kvfid.errors import BadInput, Unavailable
from kvfid.inputs.trajectories import Trajectory, as_row, items_and_codec


def _call(url: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:200].replace("\n", " ")
        raise Unavailable(f"--server {url}: HTTP {err.code} ({detail})") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise Unavailable(f"--server {url}: no answer ({err})") from None


def served_model(base: str) -> str:
    """The first model the server lists."""
    listed = _call(f"{base}/v1/models").get("data") or []
    if not listed or "id" not in listed[0]:
        raise Unavailable(f"--server {base}: /v1/models lists no model")
    return listed[0]["id"]


def completion(base: str, model: str, prompt: list[int], tokens: int, temperature: float,
               seed: int, stop_ids) -> tuple[list[int], list[float]]:
    """One sampled completion: its token ids and the server's logprob of each."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": tokens, "temperature": temperature,
            "seed": seed, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "stop_token_ids": list(stop_ids), "skip_special_tokens": False}
    choice = (_call(f"{base}/v1/completions", body).get("choices") or [None])[0]
    if not choice or not choice.get("logprobs"):
        raise Unavailable(f"--server {base}: the completion carries no logprobs")
    logprobs = choice["logprobs"].get("token_logprobs") or []
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(t, base) for t in choice["logprobs"].get("tokens") or []]
    if len(ids) != len(logprobs) or not all(isinstance(v, (int, float)) and math.isfinite(v)
                                             for v in logprobs):
        raise Unavailable(f"--server {base}: {len(ids)} token ids and {len(logprobs)} finite "
                          "logprobs do not pair up")
    return [int(i) for i in ids], [float(v) for v in logprobs]


def _token_id(token: str, base: str) -> int:
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    raise Unavailable(f"--server {base}: the server returns tokens as text ({token!r}), not ids; "
                      "kvfid needs ids (vLLM: return_tokens_as_token_ids)")


def server_rollouts(server: str, model_name: str, item_set: str, count: int, tokens: int,
                    temperature: float, seed: int, served: str | None = None) -> list[dict]:
    """The rows of `kvfid rollouts --server URL`: one completion per item, logprobs kept."""
    base = server.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise BadInput(f"--server {server!r}: an http:// or https:// URL")
    chosen, codec = items_and_codec(model_name, item_set, count)
    name = served or served_model(base)
    rows = []
    for index, item in enumerate(chosen):
        prompt = codec.prompt_ids(item.prompt)
        ids, logprobs = completion(base, name, prompt, tokens, temperature,
                                   seed * 100003 + index, sorted(codec.eos_ids))
        if ids:
            rows.append(as_row(Trajectory(item.id, tuple(prompt), tuple(ids), tuple(logprobs)),
                               model=model_name, stack=f"server {base} ({name})",
                               temperature=temperature, seed=seed))
    return rows
