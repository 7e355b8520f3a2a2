// pagellm console: polls /ui/api/state every POLL_MS and draws it; the playground streams chat
// completions from /v1/chat/completions. The API key (if the server has one) is kept in this
// tab's sessionStorage (gone when the tab closes) and sent as a Bearer token.
"use strict";
const POLL_MS = 1000;
const WINDOW_S = 180;
const $ = (id) => document.getElementById(id);
const keyInput = $("api-key");
keyInput.value = sessionStorage.getItem("pagellm-key") || "";
keyInput.addEventListener("change", () => sessionStorage.setItem("pagellm-key", keyInput.value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyInput.value) h.Authorization = "Bearer " + keyInput.value;
  return h;
}

const rateChart = new LineChart($("chart-rate"), WINDOW_S, ["#3478f6"]);
const latChart = new LineChart($("chart-lat"), WINDOW_S, ["#e67e22", "#27ae60"]);
const fleetChart = new LineChart($("chart-fleet"), WINDOW_S, ["#3478f6"]);
const history = { rate: [], fleet: [] };
let last = null;

function setStatus(state, text) {
  const el = $("status");
  el.dataset.state = state;
  el.textContent = text;
}

async function poll() {
  try {
    const resp = await fetch("/ui/api/state", { headers: headers() });
    if (resp.status === 401) { setStatus("error", "API key needed"); return; }
    if (resp.status === 403) { setStatus("error", "an operator key is needed"); return; }
    if (!resp.ok) { setStatus("error", "HTTP " + resp.status); return; }
    const state = await resp.json();
    $("kind").textContent = state.kind;
    if (state.kind === "gateway") drawFleet(state); else drawEngine(state);
  } catch (err) {
    setStatus("down", "unreachable");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function drawEngine(s) {
  $("fleet-view").hidden = true;
  $("engine-view").hidden = false;
  $("model").textContent = s.model + " · max_model_len " + s.max_model_len;
  setStatus(s.healthy ? "ok" : "down", s.healthy ? "healthy" : "engine stopped");
  for (const q of ["running", "waiting", "swapped"]) $("q-" + q).textContent = s.queues[q];
  const b = s.blocks;
  $("kv-in-use").textContent = b.in_use + " / " + b.num;
  $("kv-in-use").dataset.inUse = b.in_use;
  $("kv-usage").textContent = (100 * s.kv_usage).toFixed(1) + "%";
  const c = s.counters;
  $("prefix-hits").textContent = c.prefix_cache_queries ? (100 * c.prefix_cache_hits / c.prefix_cache_queries).toFixed(1) + "%" : "–";
  $("preemptions").textContent = c.num_preemptions;
  $("kv-legend-text").textContent = `${b.num} blocks of ${b.block_size} tokens; ${b.cached_free} free blocks hold cached prefixes`;
  if (last) {
    const dt = s.time - last.time;
    const rate = dt > 0 ? (c.generation_tokens - last.counters.generation_tokens) / dt : 0;
    history.rate.push([s.time, rate]);
    $("tok-rate").textContent = rate.toFixed(0);
  }
  last = s;
  history.rate = history.rate.filter(([t]) => t > s.time - WINDOW_S);
  rateChart.draw([history.rate], s.time);
  latChart.draw([perSecondP50(s.latencies.ttft), perSecondP50(s.latencies.itl)], s.time, ["TTFT", "ITL"]);
  drawBlocks(b);
  drawRequests(s.requests);
}

function perSecondP50(points) {
  const buckets = new Map();
  for (const [t, v] of points) {
    const k = Math.floor(t);
    if (!buckets.has(k)) buckets.set(k, []);
    buckets.get(k).push(v * 1000);
  }
  return [...buckets.entries()].sort((a, b) => a[0] - b[0]).map(([k, vs]) => {
    vs.sort((a, b) => a - b);
    return [k + 0.5, vs[Math.floor(vs.length / 2)]];
  });
}

function ownerColor(index) {
  return `hsl(${(index * 137.5) % 360}, 65%, 50%)`;
}

function drawBlocks(b) {
  const canvas = $("kv-map");
  const ctx = canvas.getContext("2d");
  const cols = Math.max(1, Math.ceil(Math.sqrt(b.num * (canvas.width / canvas.height))));
  const cell = Math.max(1, Math.floor(Math.min(canvas.width / cols, canvas.height / Math.ceil(b.num / cols))));
  const rows = Math.ceil(b.num / cols);
  canvas.height = Math.max(40, rows * cell);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const gap = cell > 3 ? 1 : 0;
  for (let i = 0; i < b.num; i++) {
    const st = b.states[i];
    ctx.fillStyle = st === "0" ? "#e3e6ec" : st === "1" ? "#9cc3e6" : st === "3" ? "#1d2330"
      : ownerColor(b.owners[i] ?? 0);
    ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
  }
}

function drawRequests(reqs) {
  const body = document.querySelector("#requests tbody");
  const rows = [];
  for (const queue of ["running", "swapped", "waiting"]) {
    reqs[queue].forEach((r, i) => {
      const done = r.prompt_tokens ? Math.min(1, r.computed_tokens / (r.prompt_tokens + r.output_tokens)) : 0;
      const color = queue === "running" ? ownerColor(i) : "#9aa3b3";
      rows.push(`<tr data-queue="${queue}"><td><i class="sw" style="background:${color}"></i>${escapeHtml(r.id)}</td>` +
        `<td>${queue}</td><td class="num"><span class="bar" style="width:${Math.round(60 * done)}px"></span>${r.computed_tokens} / ${r.prompt_tokens + r.output_tokens}</td>` +
        `<td class="num">${r.output_tokens}${r.max_tokens ? " / " + r.max_tokens : ""}</td><td class="num">${r.preemptions}</td></tr>`);
    });
  }
  body.innerHTML = rows.join("");
}

function drawFleet(s) {
  $("engine-view").hidden = true;
  $("fleet-view").hidden = false;
  const up = s.replicas.filter((r) => r.healthy).length;
  $("model").textContent = `${s.replicas.length} replicas, ${up} up`;
  setStatus(up ? "ok" : "down", up ? "serving" : "no replica up");
  const body = document.querySelector("#replicas tbody");
  body.innerHTML = s.replicas.map((r) =>
    `<tr data-url="${escapeHtml(r.url)}" data-healthy="${Boolean(r.healthy)}" data-breaker="${escapeHtml(r.breaker)}">` +
    `<td>${escapeHtml(r.url)}${r.fallback ? " (fallback)" : ""}</td><td>${r.healthy ? "up" : "down"}</td>` +
    `<td>${escapeHtml(r.breaker)}</td><td class="num">${Number(r.outstanding)}</td><td class="num">${Number(r.scraped_requests)}</td>` +
    `<td class="num"><span class="bar" style="width:${Math.round(60 * r.kv_usage)}px"></span>${(100 * r.kv_usage).toFixed(1)}%</td>` +
    `<td>${escapeHtml(r.models.join(", "))}</td></tr>`).join("");
  if (last && last.kind === "gateway") {
    const dt = s.time - last.time;
    history.fleet.push([s.time, dt > 0 ? (s.requests_total - last.requests_total) / dt : 0]);
  }
  last = s;
  history.fleet = history.fleet.filter(([t]) => t > s.time - WINDOW_S);
  fleetChart.draw([history.fleet], s.time);
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[ch]);
}

// ----- playground -------------------------------------------------------------------------
const conversation = [];

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = `<b>${role}:</b> <span></span>`;
  div.querySelector("span").textContent = text;
  $("transcript").appendChild(div);
  return div.querySelector("span");
}

function requestBody() {
  const body = {
    messages: [{ role: "system", content: $("system").value }, ...conversation],
    stream: true,
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top-p").value),
    max_tokens: parseInt($("max-tokens").value, 10),
  };
  if (!$("system").value) body.messages.shift();
  const fmt = $("format").value, text = $("constraint").value.trim();
  if (fmt === "json_object") body.response_format = { type: "json_object" };
  if (fmt === "json_schema") body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(text || "{}") } };
  if (fmt === "choice") body.structured_outputs = { choice: text.split(",").map((c) => c.trim()).filter(Boolean) };
  if (fmt === "regex") body.structured_outputs = { regex: text };
  const tools = $("tools").value.trim();
  if (tools) { body.tools = JSON.parse(tools); body.tool_choice = $("tool-choice").value; }
  return body;
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("prompt").value = "";
  conversation.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const out = addMessage("assistant", "");
  const state = $("chat-state");
  state.dataset.state = "streaming";
  state.textContent = "streaming…";
  let reply = "", calls = {};
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(requestBody()) });
    if (!resp.ok) throw new Error((await resp.json()).error.message);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new Error(event.error.message);
        const delta = (event.choices[0] || {}).delta || {};
        if (delta.content) { reply += delta.content; out.textContent = reply; }
        for (const call of delta.tool_calls || []) {
          const c = (calls[call.index] ||= { name: "", arguments: "" });
          if (call.function && call.function.name) c.name += call.function.name;
          if (call.function && call.function.arguments) c.arguments += call.function.arguments;
          out.textContent = reply + Object.values(calls).map((c) => `\n→ ${c.name}(${c.arguments})`).join("");
        }
      }
    }
    conversation.push({ role: "assistant", content: reply });
    state.dataset.state = "done";
    state.textContent = "done";
  } catch (err) {
    conversation.pop();  // the failed turn is not sent again with the next one
    out.remove();
    state.dataset.state = "error";
    state.textContent = "error: " + err.message;
  }
});

poll();
