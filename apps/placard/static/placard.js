// The placard page: camera or upload -> one streaming chat request at a time -> a museum placard
// rendered field by field as the JSON streams in, with its timings and the server's health.

import { ApiError, apiRoot, checkHealth, firstModelId, streamChat } from "./api.js";
import { DARK_LUMA, fileToCanvas, grabFrame, listCameras, meanLuma, openCamera, toJpegDataUrl } from "./capture.js";
import { parsePartialJson } from "./partial_json.js";

const FIELDS = ["title", "date_or_period", "medium", "description"];
// maxLength: small models repeat themselves; a bound keeps a placard a placard.
const PLACARD_SCHEMA = {
  type: "object",
  properties: {
    title: { type: "string", maxLength: 60 },
    date_or_period: { type: "string", maxLength: 40 },
    medium: { type: "string", maxLength: 40 },
    description: { type: "string", maxLength: 240 },
  },
  required: FIELDS,
  additionalProperties: false,
};
const PROMPT =
  "You are a museum curator. Write the placard for this picture as JSON: a title of a few words " +
  "naming what it shows, a date or period, the medium, and a description of two sentences saying " +
  "what the picture shows.";
const MAX_SIDE = 640;
const MAX_TOKENS = 200;
const HEALTHY_POLL_MS = 5000;
const SETTINGS_KEY = "placard.settings";
const CAMERA_KEY = "placard.camera";

const $ = (id) => document.getElementById(id);

// ---- settings (localStorage) ----

function defaultServerUrl() {
  return location.protocol.startsWith("http") ? location.origin : "http://127.0.0.1:8000";
}

function loadSettings() {
  const defaults = { serverUrl: defaultServerUrl(), model: "", apiKey: "", intervalS: 4 };
  try {
    return { ...defaults, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? "{}") };
  } catch {
    return defaults;
  }
}

let settings = loadSettings();
let modelId = null; // settings.model, or the server's first model once asked

function saveSettings(next) {
  settings = { ...settings, ...next, intervalS: Math.max(1, Number(next.intervalS) || 4) };
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
  modelId = null;
  health.checkNow();
  restartTimer();
}

// ---- small helpers ----

function backoffMs(attempt) {
  return Math.min(30000, 1000 * 2 ** attempt);
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(new DOMException("superseded", "AbortError"));
    });
  });
}

function seconds(ms) {
  return `${(ms / 1000).toFixed(1)} s`;
}

// ---- the banner: one line for the worst current problem ----

const banner = {
  messages: new Map(), // source -> text; the health monitor's message wins
  set(source, text) {
    if (text) this.messages.set(source, text);
    else this.messages.delete(source);
    const shown = this.messages.get("health") ?? [...this.messages.values()].at(-1);
    $("banner").hidden = !shown;
    $("banner").textContent = shown ?? "";
  },
};

// Shows `text(secondsLeft)` in the banner under `source`, counting down to zero.
function countdown(source, ms, text) {
  const end = Date.now() + ms;
  const tick = () => {
    const left = Math.max(0, Math.ceil((end - Date.now()) / 1000));
    banner.set(source, text(left));
    return left > 0;
  };
  tick();
  const timer = setInterval(() => tick() || clearInterval(timer), 1000);
  return () => clearInterval(timer);
}

// ---- the server's health ----

class HealthMonitor {
  constructor() {
    this.failures = 0;
    this.timer = null;
    this.stopCountdown = () => {};
    this.state = "unknown";
    this.round = 0; // a check started by checkNow supersedes one still waiting for its answer
  }

  checkNow() {
    clearTimeout(this.timer);
    this.check();
  }

  async check() {
    const round = ++this.round;
    const result = await checkHealth(settings);
    if (round !== this.round) return;
    this.stopCountdown();
    this.state = result.state;
    const indicator = $("health");
    indicator.dataset.state = result.state;
    indicator.textContent = `server: ${result.state === "ok" ? "ok" : result.state === "loading" ? "not ready" : "unreachable"}`;
    indicator.title = `${apiRoot(settings.serverUrl)}/health: ${result.detail}`;
    let wait = HEALTHY_POLL_MS;
    if (result.state === "ok") {
      this.failures = 0;
      banner.set("health", null);
    } else {
      wait = backoffMs(this.failures++);
      const what =
        result.state === "loading"
          ? `The server is not ready (${result.detail}).`
          : `Cannot reach the server at ${apiRoot(settings.serverUrl)}.`;
      this.stopCountdown = countdown("health", wait, (left) => `${what} Retrying in ${left} s…`);
    }
    this.timer = setTimeout(() => this.check(), wait);
  }
}

const health = new HealthMonitor();

// ---- the placard view ----

const view = {
  begin(dataUrl, fromCamera) {
    const frame = $("frame");
    frame.src = dataUrl;
    frame.hidden = false;
    frame.classList.toggle("thumb", fromCamera);
    // The last placard stays up, dimmed, until the new one's first token replaces it.
    $("placard").classList.add("stale");
    $("placard-empty").hidden = true;
    $("error").hidden = true;
    for (const id of ["ttft", "tps", "e2e"]) $(id).textContent = "…";
    this.state("waiting", "waiting for the first token");
  },

  state(state, text) {
    $("placard").dataset.state = state;
    $("status").textContent = text;
  },

  render(text) {
    let parsed;
    try {
      parsed = parsePartialJson(text);
    } catch {
      // A server that ignored response_format: show its text as it is.
      parsed = { value: { description: text }, openPath: ["description"] };
    }
    $("placard").classList.remove("stale");
    const value = parsed.value && typeof parsed.value === "object" ? parsed.value : {};
    for (const field of FIELDS) {
      const shown = value[field] == null ? "" : String(value[field]);
      if ($(field).textContent !== shown) $(field).textContent = shown;
      $(field).classList.toggle("streaming", parsed.openPath[0] === field);
    }
    return parsed;
  },

  finish() {
    for (const field of FIELDS) $(field).classList.remove("streaming");
  },

  metrics({ ttftMs, tokensPerS, e2eMs }) {
    if (ttftMs !== undefined) $("ttft").textContent = `${Math.round(ttftMs)} ms`;
    if (tokensPerS !== undefined) $("tps").textContent = tokensPerS === null ? "—" : tokensPerS.toFixed(1);
    if (e2eMs !== undefined) $("e2e").textContent = seconds(e2eMs);
  },

  error(message) {
    $("error").textContent = message;
    $("error").hidden = false;
    this.state("error", "failed");
  },
};

// ---- one placard request at a time ----

let latestSeq = 0;
let inflight = null; // {seq, controller, waitingToRetry}
let captureDue = false; // an automatic capture came while a request ran: take it when it ends

function requestBody(model, dataUrl) {
  return {
    model,
    max_tokens: MAX_TOKENS,
    temperature: 0,
    stream_options: { include_usage: true },
    response_format: { type: "json_schema", json_schema: { name: "placard", strict: true, schema: PLACARD_SCHEMA } },
    messages: [
      {
        role: "user",
        content: [
          { type: "image_url", image_url: { url: dataUrl } },
          { type: "text", text: PROMPT },
        ],
      },
    ],
  };
}

// Streams one answer into the view; returns false when superseded by a newer capture.
async function streamPlacard(dataUrl, startedAt, isCurrent, signal) {
  modelId ??= settings.model || (await firstModelId(settings));
  const sentAt = performance.now();
  let firstAt = null;
  let text = "";
  let chunks = 0;
  let usage = null;
  let finishReason = null;
  view.state("waiting", "waiting for the first token");
  for await (const chunk of streamChat(settings, requestBody(modelId, dataUrl), signal)) {
    if (!isCurrent()) return false;
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (choice?.finish_reason) finishReason = choice.finish_reason;
    const delta = choice?.delta?.content;
    if (!delta) continue;
    const now = performance.now();
    if (firstAt === null) {
      firstAt = now;
      view.metrics({ ttftMs: firstAt - sentAt });
      view.state("streaming", "streaming");
    }
    text += delta;
    chunks += 1;
    view.render(text);
    if (chunks > 1) view.metrics({ tokensPerS: (chunks - 1) / ((now - firstAt) / 1000) });
  }
  if (!isCurrent()) return false;
  const endAt = performance.now();
  // Decode rate: the tokens after the first over the time after the first (the usage count when
  // the server sends one; else one token per content chunk).
  const tokens = usage?.completion_tokens ?? chunks;
  const decodeS = firstAt === null ? 0 : (endAt - firstAt) / 1000;
  view.metrics({ tokensPerS: tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null, e2eMs: endAt - startedAt });
  const parsed = view.render(text);
  view.finish();
  if (finishReason === "length" && !parsed.complete) view.state("done", `cut off after ${tokens} tokens`);
  else view.state("done", `done: ${tokens} tokens`);
  return true;
}

// A newer capture aborts the request in flight; stale chunks are never rendered (isCurrent).
async function describe(dataUrl, startedAt, fromCamera) {
  inflight?.controller.abort();
  const seq = ++latestSeq;
  const controller = new AbortController();
  inflight = { seq, controller, waitingToRetry: false };
  const isCurrent = () => seq === latestSeq;
  view.begin(dataUrl, fromCamera);
  for (let attempt = 0; isCurrent(); attempt++) {
    try {
      await streamPlacard(dataUrl, startedAt, isCurrent, controller.signal);
      break;
    } catch (err) {
      if (err.name === "AbortError" || !isCurrent()) return;
      if (!(err instanceof ApiError) || !err.retryable) {
        view.error(err.message);
        break;
      }
      if (err.status === 0) health.checkNow();
      const wait = backoffMs(attempt);
      view.state("retrying", "retrying");
      $("status").title = err.message;
      const stop = countdown("request", wait, (left) => `The request failed: ${err.message}. Retrying in ${left} s…`);
      inflight.waitingToRetry = true;
      try {
        await sleep(wait, controller.signal);
      } catch {
        return; // superseded while waiting
      } finally {
        stop();
        banner.set("request", null);
      }
      inflight.waitingToRetry = false;
    }
  }
  if (!isCurrent()) return;
  banner.set("request", null);
  inflight = null;
  if (captureDue) {
    captureDue = false;
    if ($("auto").checked) captureFromCamera();
  }
}

// ---- sources: camera and uploads ----

let stream = null;

function captureFromCamera() {
  const startedAt = performance.now();
  const canvas = grabFrame($("camera"), MAX_SIDE);
  if (canvas === null) return;
  const luma = meanLuma(canvas);
  if (luma < DARK_LUMA) {
    $("capture-note").textContent = `Skipped a dark frame (mean brightness ${Math.round(luma)}/255).`;
    return;
  }
  $("capture-note").textContent = `Captured ${canvas.width}×${canvas.height} at ${new Date().toLocaleTimeString()}.`;
  describe(toJpegDataUrl(canvas), startedAt, true);
}

// Automatic captures never abort a request that is running: they wait for it (one fresh frame,
// not a queue). One that is only waiting to retry is replaced by the newer frame.
function automaticCapture() {
  if (!stream || !$("auto").checked) return;
  if (inflight && !inflight.waitingToRetry) {
    captureDue = true;
    return;
  }
  captureFromCamera();
}

let timer = null;
function restartTimer() {
  clearInterval(timer);
  timer = setInterval(automaticCapture, settings.intervalS * 1000);
}

async function describeFile(file) {
  if (!file) return;
  const startedAt = performance.now();
  $("auto").checked = false; // an uploaded photo stays until the user asks for the camera again
  try {
    const canvas = await fileToCanvas(file, MAX_SIDE);
    $("capture-note").textContent = `${file.name}: ${canvas.width}×${canvas.height}.`;
    describe(toJpegDataUrl(canvas), startedAt, false);
  } catch (err) {
    view.error(err.message);
  }
}

async function startCamera(deviceId) {
  const video = $("camera");
  const message = $("camera-message");
  stream?.getTracks().forEach((track) => track.stop());
  stream = null;
  try {
    stream = await openCamera(deviceId);
  } catch (err) {
    if (deviceId && err.reason === "missing") return startCamera(null); // the saved camera is gone
    video.hidden = true;
    message.hidden = false;
    message.dataset.reason = err.reason ?? "error";
    message.textContent = err.message;
    $("capture-button").disabled = true;
    $("drop-zone").classList.add("upload-first");
    return;
  }
  video.srcObject = stream;
  video.hidden = false;
  message.hidden = true;
  $("capture-button").disabled = false;
  $("drop-zone").classList.remove("upload-first");
  const current = stream.getVideoTracks()[0]?.getSettings().deviceId;
  const picker = $("camera-picker");
  picker.replaceChildren(
    ...(await listCameras()).map(({ deviceId: id, label }) => new Option(label, id, false, id === current)),
  );
  $("camera-picker-label").hidden = picker.options.length === 0;
  // The first placard as soon as there is a frame, not one interval later.
  video.addEventListener("loadeddata", () => automaticCapture(), { once: true });
}

// ---- wiring ----

function fillSettingsForm() {
  const form = $("settings-form");
  for (const [name, value] of Object.entries(settings)) if (form.elements[name]) form.elements[name].value = value;
}

function main() {
  fillSettingsForm();
  $("settings-form").addEventListener("submit", (event) => {
    event.preventDefault();
    saveSettings(Object.fromEntries(new FormData(event.target)));
    $("settings").open = false;
  });
  $("capture-button").addEventListener("click", () => captureFromCamera());
  $("auto").addEventListener("change", () => $("auto").checked && automaticCapture());
  $("upload-input").addEventListener("change", (event) => {
    describeFile(event.target.files[0]);
    event.target.value = ""; // choosing the same file again is a new request
  });
  const zone = $("drop-zone");
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("dragging");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    describeFile(event.dataTransfer.files[0]);
  });
  $("camera-picker").addEventListener("change", (event) => {
    localStorage.setItem(CAMERA_KEY, event.target.value);
    startCamera(event.target.value);
  });
  health.checkNow();
  restartTimer();
  startCamera(localStorage.getItem(CAMERA_KEY));
}

main();
