// The mesh chat page: plain JS, no build step, nothing fetched from elsewhere.
// It talks only to the coordinator's own API: GET /v1/models (the model name), POST /v1/chat/completions with
// stream=true (Server-Sent Events read through fetch's ReadableStream, so Stop can abort it: the server then frees
// the sequence's slot), and GET /v1/mesh (the status panel). With an API key, every call sends it as a Bearer token.
"use strict";

const KEY_STORE = "mesh.apiKey";
const STATUS_EVERY_MS = 2000;
const $ = (id) => document.getElementById(id);

const state = {
  model: null,
  messages: [],          // the conversation as the API wants it: {role, content}
  controller: null,      // the AbortController of the answer streaming now, if any
  key: localStorage.getItem(KEY_STORE) || "",
};

class AuthNeeded extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.key) headers["Authorization"] = "Bearer " + state.key;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) throw new AuthNeeded(await errorText(response));
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

// ---- API key --------------------------------------------------------------------------------------------------
function askForKey(reason) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !state.key;           // a key we had was refused: say so
  $("key-error").textContent = reason || "";
  $("key-input").value = "";
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

$("key-form").addEventListener("submit", () => {
  state.key = $("key-input").value.trim();
  localStorage.setItem(KEY_STORE, state.key);
  start();
});

// ---- chat -----------------------------------------------------------------------------------------------------
function addBubble(role, text) {
  $("empty").hidden = true;
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function note(bubble, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  bubble.appendChild(span);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").disabled = false;
}

// Server-Sent Events: events are separated by a blank line; each `data:` line carries one JSON chunk or [DONE].
async function* sseData(body, signal) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (data.length) yield data.join("\n");
      }
    }
  } finally {
    if (signal.aborted) reader.cancel().catch(() => {});
  }
}

async function send(text) {
  const convo = state.messages;              // New chat during this answer starts another array; this one ends here
  convo.push({ role: "user", content: text });
  addBubble("user", text);
  const bubble = addBubble("assistant streaming", "");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let answer = "", chunks = 0, first = 0, finish = null;
  const body = {
    model: state.model || undefined,
    messages: convo,
    stream: true,
    max_tokens: Number($("max-tokens").value) || undefined,
    temperature: Number($("temperature").value) || 0,
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" },
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response.body, controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      const choice = (chunk.choices || [])[0] || {};
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        if (!chunks) first = performance.now();
        chunks += 1;
        answer += piece;
        bubble.textContent = answer;
        bubble.scrollIntoView({ block: "end" });
        if (chunks > 1) $("speed").textContent = `${(1000 * (chunks - 1) / (performance.now() - first)).toFixed(1)} tok/s`;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (finish === "length") note(bubble, "(stopped at the token limit)");
  } catch (err) {
    if (err instanceof AuthNeeded) {
      bubble.previousSibling.remove();          // the turn never started: the text goes back to the input
      bubble.remove();
      $("input").value = text;
      askForKey(err.message);
    } else if (controller.signal.aborted) {
      note(bubble, "(stopped)");
    } else {
      bubble.classList.add("failed");
      note(bubble, "Error: " + err.message);
    }
  } finally {
    bubble.classList.remove("streaming");
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
  // The conversation holds what was shown, also an answer stopped part way; a turn with no answer is dropped.
  if (answer) convo.push({ role: "assistant", content: answer });
  else convo.pop();
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.messages = [];
  for (const el of [...$("messages").querySelectorAll(".msg")]) el.remove();
  $("empty").hidden = false;
  $("speed").textContent = "";
  $("input").focus();
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", newChat);
$("toggle-status").addEventListener("click", () => {
  const panel = $("status");
  panel.hidden = !panel.hidden;
  $("toggle-status").setAttribute("aria-expanded", String(!panel.hidden));
  if (!panel.hidden) pollStatus();
});

// ---- status ---------------------------------------------------------------------------------------------------
function cell(row, text, cls, sub) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  if (sub) {
    const s = document.createElement("span");
    s.className = "sub";
    s.textContent = sub;
    td.appendChild(s);
  }
  row.appendChild(td);
}

const fmt = (v, digits) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

function renderStatus(st) {
  const summary = $("status-summary");
  summary.textContent = "";
  const parts = [];
  const stateEl = document.createElement("b");
  stateEl.textContent = st.state + (st.detail ? ` (${st.detail})` : "");
  stateEl.className = "state-" + st.state;
  summary.appendChild(stateEl);
  if (st.chain) parts.push(`${st.chain} chain`);
  const s = st.scheduler;
  if (s) {
    parts.push(`${fmt(s.active, 0)} active of ${fmt(s.max_seqs, 0)}`);
    parts.push(`${fmt(s.queued, 0)} queued`);
    if (s.ms_per_step !== null && s.ms_per_step !== undefined) parts.push(`${fmt(s.ms_per_step, 1)} ms a step`);
  }
  if (st.pool) parts.push(`${st.pool} waiting in the pool`);
  if (st.predicted_tok_per_s !== null && st.predicted_tok_per_s !== undefined) {
    parts.push(`planner: ${fmt(st.predicted_tok_per_s, 1)} tok/s`);
  }
  summary.appendChild(document.createTextNode(parts.length ? " · " + parts.join(" · ") : ""));
  for (const line of (st.placement && st.placement.left_out) || []) {
    const div = document.createElement("div");
    div.textContent = line;                     // a peer the planner left out, with its figures
    summary.appendChild(div);
  }
  summary.dataset.active = s ? String(s.active) : "";

  const body = $("stages").querySelector("tbody");
  body.textContent = "";
  (st.stages || []).forEach((stage, k) => {
    const row = document.createElement("tr");
    cell(row, String(k + 1));
    // "peer 2 (10.0.0.6)": the name on one line, the host under it
    const m = /^(.*) \((.*)\)$/.exec(stage.name);
    cell(row, m ? m[1] : stage.name, "", m ? m[2] : stage.host || "");
    cell(row, stage.device || "–", "", stage.memory_mb ? `${(stage.memory_mb / 1024).toFixed(1)} GB` : "");
    cell(row, stage.layers ? `${stage.layers[0]}..${stage.layers[1]}` : "–", "",
         stage.kv_blocks ? `KV ${stage.kv_blocks * (stage.kv_block_size || 1)} pos` : "");
    cell(row, fmt(stage.ms_per_step, 1), "num");
    cell(row, fmt(stage.tok_per_s, 1), "num",
         stage.busy !== null && stage.busy !== undefined ? `${Math.round(100 * stage.busy)}% busy` : "");
    body.appendChild(row);
  });

  const hops = $("hops");
  hops.textContent = "";
  for (const hop of st.hops || []) {
    const li = document.createElement("li");
    li.appendChild(document.createTextNode(`${hop.from} → ${hop.to} `));
    const tag = document.createElement("span");
    tag.className = "tag";
    tag.textContent = hop.transport || "?";
    li.appendChild(tag);
    hops.appendChild(li);
  }
  $("status-error").hidden = true;
}

let statusTimer = null;
async function pollStatus() {
  clearTimeout(statusTimer);
  try {
    if (!document.hidden && !$("status").hidden) {   // nobody looks: no request (each one asks every stage)
      const response = await api("/v1/mesh");
      if (!response.ok) throw new Error(await errorText(response));
      renderStatus(await response.json());
    }
  } catch (err) {
    if (err instanceof AuthNeeded) return askForKey(err.message);
    $("status-error").hidden = false;
    $("status-error").textContent = "Status unavailable: " + err.message;
  }
  statusTimer = setTimeout(pollStatus, STATUS_EVERY_MS);
}

// ---- start ----------------------------------------------------------------------------------------------------
async function start() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    const models = (await response.json()).data || [];
    state.model = models.length ? models[0].id : null;
    $("model").textContent = state.model || "(no model)";
    document.title = state.model ? `mesh · ${state.model}` : "mesh";
  } catch (err) {
    if (err instanceof AuthNeeded) return askForKey(err.message);
    $("model").textContent = "unreachable: " + err.message;
  }
  pollStatus();
  $("input").focus();
}

document.addEventListener("visibilitychange", () => { if (!document.hidden) pollStatus(); });
start();
