// The asyncengine playground: plain JavaScript, no build step, no network beyond this server.
// It streams over the /v1/ws websocket (protocol in asyncengine/entrypoints/websocket.py); several
// generations share the one connection, each with its own request id and output panel.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "asyncengine.apiKey"; // sessionStorage only: gone when the tab closes
const ERROR_NAMES = { 400: "bad request", 401: "unauthorized", 413: "too large", 429: "too many requests",
  500: "server error", 503: "server unavailable" };
const MAX_PANELS = 12;

let socket = null;
let opened = false; // whether the current socket ever opened (a refused handshake never does)
let retryMs = 500;
let retryTimer = null;
let nextId = 1;
const runs = new Map(); // request id -> live run
const chat = []; // the conversation: {role, content}

function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }

function alertMessage(text) {
  const p = document.createElement("p");
  p.className = "error";
  p.textContent = text;
  const close = document.createElement("button");
  close.type = "button";
  close.textContent = "×";
  close.setAttribute("aria-label", "dismiss");
  close.onclick = () => p.remove();
  p.append(" ", close);
  $("alerts").prepend(p);
  while ($("alerts").children.length > 5) $("alerts").lastChild.remove();
}

function setStatus(text, state) {
  $("conn-status").textContent = text;
  $("conn-status").dataset.state = state;
}

// -- the model and the API key ---------------------------------------------------------------
async function loadModel() {
  const headers = apiKey() ? { Authorization: `Bearer ${apiKey()}` } : {};
  let r;
  try {
    r = await fetch("/v1/models", { headers });
  } catch (e) {
    retryLater("server unreachable");
    return;
  }
  if (r.status === 401) {
    $("key-reason").textContent = apiKey()
      ? "401: the server refused this API key. Enter the right one."
      : "This server needs an API key.";
    if (apiKey()) alertMessage("401 unauthorized: wrong API key");
    $("key-form").hidden = false;
    $("api-key").focus();
    setStatus("waiting for the API key", "off");
    return;
  }
  if (!r.ok) {
    const body = await r.json().catch(() => ({}));
    const msg = (body.error && body.error.message) || r.statusText;
    retryLater(`model unavailable (${r.status}: ${msg})`);
    return;
  }
  const card = (await r.json()).data[0];
  $("key-form").hidden = true;
  $("model-info").textContent = modelLine(card);
  connect();
}

function modelLine(card) {
  const parts = [`model ${card.id}`, `max_model_len ${card.max_model_len}`];
  if (card.dtype) parts.push(card.dtype);
  const p = card.parallel;
  if (p) {
    parts.push(`tp ${p.tensor_parallel_size} × pp ${p.pipeline_parallel_size} × dp ${p.data_parallel_size}`
      + ` (${p.distributed_executor_backend})`);
  }
  return parts.join(" · ");
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
  $("api-key").value = "";
  loadModel();
});

// -- the websocket ---------------------------------------------------------------------------
function connect() {
  clearTimeout(retryTimer);
  if (socket && socket.readyState <= WebSocket.OPEN) return;
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws`;
  // a browser cannot set Authorization on a websocket: the key travels as a subprotocol
  const protocols = apiKey() ? ["asyncengine", `asyncengine.bearer.${apiKey()}`] : ["asyncengine"];
  try {
    socket = new WebSocket(url, protocols);
  } catch (e) {
    alertMessage(`cannot open the websocket: ${e.message} (does the API key hold odd characters?)`);
    return;
  }
  opened = false;
  setStatus("connecting…", "off");
  socket.onopen = () => {
    opened = true;
    retryMs = 500;
    setStatus("connected", "on");
  };
  socket.onmessage = (e) => onFrame(JSON.parse(e.data));
  socket.onclose = (e) => {
    for (const run of runs.values()) finish(run, "error", "the connection closed");
    runs.clear();
    const why = opened
      ? `connection closed (code ${e.code}${e.reason ? ": " + e.reason : ""})`
      : "the server refused the websocket handshake (wrong API key, or the server is down)";
    alertMessage(why);
    retryLater("disconnected");
  };
}

// reconnects through loadModel: a restarted server may serve another model, or want another key
function retryLater(why) {
  setStatus(`${why}; retrying in ${(retryMs / 1000).toFixed(1)} s`, "off");
  clearTimeout(retryTimer);
  retryTimer = setTimeout(loadModel, retryMs);
  retryMs = Math.min(retryMs * 2, 15000);
}

function onFrame(f) {
  let run = runs.get(f.request_id);
  if (run) run.answered = true;
  if (f.type === "error") {
    // a frame over the server's size limit is refused unread, so its error names no request: it is the
    // largest frame still unanswered (every frame over the limit is larger than every frame under it)
    if (!run && f.request_id == null && f.code === 413) run = largestUnanswered();
    const param = f.param && !f.message.startsWith(f.param) ? ` (${f.param})` : "";
    const text = `${f.code} ${ERROR_NAMES[f.code] || "error"}: ${f.message}${param}`;
    alertMessage(run ? `${run.label}: ${text}` : text);
    if (run) finish(run, "error", text);
    return;
  }
  if (!run) return;
  if (f.type === "delta") {
    const now = performance.now();
    if (run.firstAt === null) run.firstAt = now;
    run.lastAt = now;
    run.tokens += f.token_ids.length;
    run.frames += 1;
    run.text += f.text;
    run.genEl.textContent = run.text;
    showStats(run);
  } else if (f.type === "done") {
    if (f.usage) run.tokens = f.usage.completion_tokens;
    finish(run, f.finish_reason);
  }
}

function largestUnanswered() {
  let found;
  for (const run of runs.values()) {
    if (!run.answered && (!found || run.frameLength > found.frameLength)) found = run;
  }
  return found;
}

// -- generations -----------------------------------------------------------------------------
function numberOf(id) {
  const v = $(id).valueAsNumber;
  return Number.isNaN(v) ? undefined : v;
}

function samplingParams(temperature, structured) {
  const params = { temperature, top_p: numberOf("top_p"), top_k: numberOf("top_k"),
    max_tokens: numberOf("max_tokens"), seed: numberOf("seed"), structured_outputs: structured };
  const stop = $("stop").value.split("\n").filter((s) => s).map((s) => s.replaceAll("\\n", "\n"));
  if (stop.length) params.stop = stop;
  if ($("ignore_eos").checked) params.ignore_eos = true;
  for (const k of Object.keys(params)) if (params[k] === undefined) delete params[k];
  return params;
}

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function send() {
  if (!socket || socket.readyState !== WebSocket.OPEN) {
    alertMessage("not connected to the server yet");
    return;
  }
  let structured;
  try {
    structured = structuredOutputs();
  } catch (e) {
    structuredError(e.message); // checked before the chat history changes: nothing is sent
    return;
  }
  const text = $("prompt").value;
  const temps = [numberOf("temperature") ?? 1];
  if ($("compare").checked) temps.push(numberOf("compare-temp") ?? 0);
  let input;
  if (mode() === "chat") {
    if (!text.trim()) return;
    chat.push({ role: "user", content: text });
    renderChat();
    $("prompt").value = "";
    const system = $("system").value.trim();
    input = { messages: (system ? [{ role: "system", content: system }] : []).concat(chat) };
  } else {
    input = { prompt: text };
  }
  temps.forEach((t, i) => start(input, samplingParams(t, structured), i === 0));
}

function start(input, params, primary) {
  const id = `r${nextId++}`;
  const el = $("run-template").content.firstElementChild.cloneNode(true);
  const run = { id, el, params, primary, mode: mode(), prompt: input.prompt ?? "", text: "", tokens: 0,
    frames: 0, sentAt: performance.now(), firstAt: null, lastAt: null, finish: null,
    label: `${id} · temperature ${params.temperature}`, genEl: el.querySelector(".run-gen"),
    answered: false, frameLength: 0 };
  if (params.structured_outputs) run.label += ` · ${Object.keys(params.structured_outputs)[0]}`;
  el.dataset.requestId = id;
  el.querySelector(".run-label").textContent = run.label;
  el.querySelector(".run-stop").setAttribute("aria-label", `Stop ${id}`);
  el.querySelector(".run-reuse").setAttribute("aria-label", `Use ${id}'s text as the prompt`);
  el.querySelector(".run-prompt").textContent = run.prompt;
  el.querySelector(".run-stop").onclick = () => cancel(run);
  el.querySelector(".run-reuse").onclick = () => { $("prompt").value = run.prompt + run.text; };
  $("runs").prepend(el);
  while ($("runs").children.length > MAX_PANELS) $("runs").lastChild.remove();
  runs.set(id, run);
  showStats(run);
  const frame = JSON.stringify({ type: "generate", request_id: id, ...input, params });
  run.frameLength = frame.length;
  socket.send(frame);
}

function cancel(run) {
  if (runs.has(run.id) && socket && socket.readyState === WebSocket.OPEN) {
    socket.send(JSON.stringify({ type: "cancel", request_id: run.id }));
  }
}

function stopAll() { for (const run of runs.values()) cancel(run); }

function finish(run, reason, error) {
  runs.delete(run.id);
  run.finish = reason;
  run.el.classList.add(error ? "failed" : "finished");
  run.el.querySelector(".run-stop").hidden = true;
  if (run.mode === "completion" && !error) run.el.querySelector(".run-reuse").hidden = false;
  if (error) {
    const p = document.createElement("p");
    p.className = "error";
    p.textContent = error;
    run.el.append(p);
  }
  if (run.mode === "chat" && run.primary && !error && reason !== "abort") {
    chat.push({ role: "assistant", content: run.text });
    renderChat();
  }
  showStats(run);
}

function showStats(run) {
  const parts = [];
  if (run.firstAt !== null) parts.push(`TTFT ${Math.round(run.firstAt - run.sentAt)} ms`);
  if (run.tokens > 1 && run.lastAt > run.firstAt) {
    parts.push(`${((run.tokens - 1) / ((run.lastAt - run.firstAt) / 1000)).toFixed(1)} tokens/s`);
  }
  parts.push(`${run.tokens} tokens`);
  parts.push(run.finish ? `finish: ${run.finish}` : "running…");
  const stats = run.el.querySelector(".run-stats");
  stats.textContent = parts.join(" · ");
  stats.dataset.finish = run.finish || "";
}

function renderChat() {
  $("chat-log").replaceChildren(...chat.map((m) => {
    const li = document.createElement("li");
    li.className = m.role;
    const who = document.createElement("strong");
    who.textContent = `${m.role}: `;
    li.append(who, m.content);
    return li;
  }));
}

// -- structured output -----------------------------------------------------------------------
// what params.structured_outputs takes (asyncengine/structured_output/spec.py), one kind at a time
const STRUCTURED = {
  json: { label: "JSON schema",
    placeholder: '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}',
    help: "A JSON Schema object: the output is JSON that matches it." },
  regex: { label: "Regular expression", placeholder: "[0-9]{3}-[0-9]{4}",
    help: "The whole output matches it (Rust regex syntax: no look-around)." },
  choice: { label: "Choices, one per line", placeholder: "yes\nno",
    help: "The output is exactly one of these lines." },
  grammar: { label: "Grammar", placeholder: 'root ::= "yes" | "no"',
    help: "GBNF (root ::= ...) or Lark (start: ...)." },
};

// params.structured_outputs from the box, or an Error whose message tells the user what to fix; the
// server checks the rest (a schema it cannot compile comes back as a 400 error frame)
function structuredOutputs() {
  const kind = $("so-kind").value;
  if (!kind) return undefined;
  const raw = $("so-value").value;
  if (kind === "json") {
    let schema;
    try {
      schema = JSON.parse(raw);
    } catch (e) {
      throw new Error(`The JSON schema is not valid JSON: ${e.message}`);
    }
    if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
      throw new Error('The JSON schema must be a JSON object, such as {"type": "object"}.');
    }
    return { json: schema };
  }
  if (kind === "choice") {
    const choices = raw.split("\n").filter((c) => c); // spaces kept: a choice is the exact text
    if (!choices.length) throw new Error("Give at least one choice, one per line.");
    return { choice: choices };
  }
  if (!raw.trim()) throw new Error(`The ${STRUCTURED[kind].label.toLowerCase()} is empty.`);
  return { [kind]: raw };
}

function structuredError(message) {
  $("so-error").textContent = message;
  $("so-error").hidden = !message;
  if (message) {
    $("so-value").setAttribute("aria-invalid", "true");
    $("so-value").focus();
  } else {
    $("so-value").removeAttribute("aria-invalid");
  }
}

function setStructuredKind() {
  const kind = STRUCTURED[$("so-kind").value];
  $("so-box").hidden = !kind;
  structuredError("");
  if (!kind) return;
  $("so-label").textContent = kind.label;
  $("so-value").placeholder = kind.placeholder;
  $("so-help").textContent = kind.help;
}

// -- controls --------------------------------------------------------------------------------
function setMode() {
  const isChat = mode() === "chat";
  $("chat-box").hidden = !isChat;
  $("prompt-label").textContent = isChat ? "Message" : "Prompt";
}

for (const r of document.querySelectorAll("input[name=mode]")) r.addEventListener("change", setMode);
$("so-kind").addEventListener("change", setStructuredKind);
$("so-value").addEventListener("input", () => structuredError(""));
$("send").addEventListener("click", send);
$("stop-all").addEventListener("click", stopAll);
$("clear-runs").addEventListener("click", () => {
  for (const el of [...$("runs").children]) if (!runs.has(el.dataset.requestId)) el.remove();
});
$("clear-chat").addEventListener("click", () => { chat.length = 0; renderChat(); });
document.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); }
  else if (e.key === "Escape") stopAll();
});

setMode();
setStructuredKind();
loadModel();
