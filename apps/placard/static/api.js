// The public OpenAI-compatible HTTP API, as the placard page uses it: health, models, and a
// streaming chat completion read as server-sent events. Works against vlm-engine, vLLM, SGLang or
// llama-server; nothing here knows which.

export class ApiError extends Error {
  // status 0: the server could not be reached at all. retryable: worth trying again later
  // (unreachable, 429, 5xx); anything else is the request's fault and is shown as it is.
  constructor(message, status, retryable) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.retryable = retryable;
  }
}

// "http://host:8000/v1/" and "http://host:8000" name the same server.
export function apiRoot(serverUrl) {
  return serverUrl.trim().replace(/\/+$/, "").replace(/\/v1$/, "");
}

function headers(settings, json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  if (settings.apiKey) out["Authorization"] = `Bearer ${settings.apiKey}`;
  return out;
}

async function send(settings, path, init) {
  try {
    return await fetch(apiRoot(settings.serverUrl) + path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`cannot reach the server at ${apiRoot(settings.serverUrl)}`, 0, true);
  }
}

// The OpenAI error body's message when there is one, else the status line.
async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    message = body?.error?.message ?? body?.message ?? body?.detail ?? message;
  } catch {
    // not JSON: keep the status line
  }
  const retryable = response.status === 429 || response.status >= 500;
  return new ApiError(String(message), response.status, retryable);
}

// {state: "ok" | "loading" | "down", detail}. Servers without /health (404) are asked for
// /v1/models instead.
export async function checkHealth(settings, signal) {
  try {
    let response = await send(settings, "/health", { headers: headers(settings, false), signal });
    if (response.status === 404) {
      response = await send(settings, "/v1/models", { headers: headers(settings, false), signal });
    }
    if (response.ok) return { state: "ok", detail: "ok" };
    const error = await errorFrom(response);
    if (response.status === 503) return { state: "loading", detail: error.message };
    return { state: "down", detail: error.message };
  } catch (err) {
    if (err.name === "AbortError") throw err;
    return { state: "down", detail: err.message };
  }
}

export async function firstModelId(settings) {
  const response = await send(settings, "/v1/models", { headers: headers(settings, false) });
  if (!response.ok) throw await errorFrom(response);
  const body = await response.json();
  const id = body?.data?.[0]?.id;
  if (!id) throw new ApiError("the server lists no models", response.status, false);
  return id;
}

// Yields each chunk object of a streaming chat completion; an error event in the stream (the
// server's own message) is thrown as ApiError.
export async function* streamChat(settings, body, signal) {
  const response = await send(settings, "/v1/chat/completions", {
    method: "POST",
    headers: headers(settings, true),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await errorFrom(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  let finished = false;
  try {
    for (;;) {
      let read;
      try {
        read = await reader.read();
      } catch (err) {
        if (err.name === "AbortError") throw err;
        throw new ApiError("the connection to the server broke mid-answer", 0, true);
      }
      if (read.done) {
        finished = true;
        return;
      }
      buffered += read.value;
      const events = buffered.split(/\r?\n\r?\n/);
      buffered = events.pop();
      for (const event of events) {
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "") continue;
        if (data === "[DONE]") {
          // The server closes the stream next: read that close rather than cancel a response
          // that is complete (a cancelled one counts as a failed request in the network log).
          while (!(await reader.read()).done);
          finished = true;
          return;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.message ?? String(chunk.error), 500, false);
        yield chunk;
      }
    }
  } finally {
    if (!finished) reader.cancel().catch(() => {}); // a stream left early (error, abort) frees its connection
  }
}
