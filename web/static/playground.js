// The trillm playground: chat over the /v1/ws websocket, a live server panel from /stats.
// Model output is only ever put into the page as text (textContent / text nodes), never parsed as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "trillm-api-key";

  const state = {
    key: sessionStorage.getItem(KEY_STORAGE),
    ws: null, // the open (or opening) socket
    wsOpen: null, // a promise of it, open
    history: [], // the conversation sent with each request: [{role, content}]
    turn: null, // the answer being generated
    nextId: 1,
    statsTimer: null,
  };

  // ---- small DOM helpers (text only) ----

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setConn(text, kind) {
    const conn = $("conn");
    conn.textContent = text;
    conn.dataset.state = kind;
  }

  function scrollToEnd() {
    const log = $("log");
    log.scrollTop = log.scrollHeight;
  }

  // ---- markdown subset: fenced code blocks and `inline code`; everything else stays plain text ----

  const FENCE_OPEN = /^\s*```\s*([\w+#.-]*)\s*$/;
  const FENCE_CLOSE = /^\s*```\s*$/;

  function appendInline(parent, text) {
    for (const part of text.split(/(`[^`\n]+`)/)) {
      if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
        parent.append(el("code", "", part.slice(1, -1)));
      } else if (part) {
        parent.append(document.createTextNode(part));
      }
    }
  }

  function renderMarkdown(container, text) {
    const nodes = [];
    let prose = [];
    let code = null; // lines of the open code block
    let lang = "";
    const flushProse = () => {
      const joined = prose.join("\n").replace(/^\n+|\n+$/g, ""); // blank lines around a code block
      if (joined) {
        const div = el("div", "text");
        appendInline(div, joined);
        nodes.push(div);
      }
      prose = [];
    };
    const flushCode = () => {
      const pre = el("pre");
      if (lang) pre.dataset.lang = lang;
      pre.append(el("code", "", code.join("\n")));
      nodes.push(pre);
      code = null;
    };
    for (const line of text.split("\n")) {
      if (code === null) {
        const open = FENCE_OPEN.exec(line);
        if (open) {
          flushProse();
          code = [];
          lang = open[1];
        } else {
          prose.push(line);
        }
      } else if (FENCE_CLOSE.test(line)) {
        flushCode();
      } else {
        code.push(line);
      }
    }
    if (code !== null) flushCode(); // still streaming, or never closed: show it as code anyway
    flushProse();
    container.replaceChildren(...nodes);
  }

  // ---- API key ----

  function authHeaders() {
    return state.key ? { Authorization: "Bearer " + state.key } : {};
  }

  function base64url(text) {
    let binary = "";
    for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
    return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function askForKey(message) {
    $("keybar").hidden = false;
    $("keyerror").textContent = message || "";
    setConn("API key needed", "error");
    $("apikey").focus();
  }

  // ---- models ----

  async function loadModels() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (err) {
      setConn("server unreachable", "error");
      return false;
    }
    if (response.status === 401) {
      if (state.key) sessionStorage.removeItem(KEY_STORAGE);
      askForKey(state.key ? "That key was refused." : "");
      state.key = null;
      return false;
    }
    if (!response.ok) {
      setConn(`/v1/models: HTTP ${response.status}`, "error");
      return false;
    }
    const body = await response.json();
    const select = $("model");
    const previous = select.value;
    select.replaceChildren();
    for (const model of body.data) {
      const option = el("option", "", model.ready ? model.id : `${model.id} (loading)`);
      option.value = model.id;
      select.append(option);
    }
    if (previous && body.data.some((m) => m.id === previous)) select.value = previous;
    $("keybar").hidden = true;
    if (state.key) sessionStorage.setItem(KEY_STORAGE, state.key);
    return true;
  }

  // ---- the websocket ----

  function connect() {
    if (state.ws && state.ws.readyState <= WebSocket.OPEN) return state.wsOpen;
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const protocols = ["trillm"];
    if (state.key) protocols.push("trillm.bearer." + base64url(state.key));
    const ws = new WebSocket(scheme + location.host + "/v1/ws", protocols);
    state.ws = ws;
    setConn("connecting…", "idle");
    state.wsOpen = new Promise((resolve, reject) => {
      ws.onopen = () => {
        setConn("connected", "open");
        resolve(ws);
      };
      ws.onclose = () => {
        reject(new Error("could not connect to /v1/ws"));
        if (state.ws === ws) {
          state.ws = null;
          setConn("disconnected", "error");
        }
        if (state.turn && state.turn.ws === ws) finishTurn(state.turn, "error", { message: "the connection closed" });
      };
    });
    ws.onmessage = (event) => onMessage(JSON.parse(event.data));
    return state.wsOpen;
  }

  function onMessage(msg) {
    const turn = state.turn;
    if (!turn || msg.id !== turn.id) {
      // (an error for a finished id is a cancel that crossed the "done": nothing to show)
      if (msg.type === "error" && msg.id === null) setConn(msg.error.message, "error");
      return;
    }
    const now = performance.now();
    if (msg.type === "delta") {
      if (turn.tFirst === null && (msg.token_ids.length || msg.text)) turn.tFirst = now;
      if (msg.token_ids.length) turn.tLast = now;
      turn.tokens += msg.token_ids.length;
      turn.text += msg.text;
      turn.reasoning += msg.reasoning || "";
      for (const call of msg.tool_calls || []) {
        const seen = turn.calls[call.index] || (turn.calls[call.index] = { name: "", arguments: "" });
        seen.name += (call.function && call.function.name) || "";
        seen.arguments += (call.function && call.function.arguments) || "";
      }
      scheduleRender(turn);
    } else if (msg.type === "done") {
      finishTurn(turn, "done", { usage: msg.usage, finish: msg.finish_reasons[0] });
    } else if (msg.type === "cancelled") {
      finishTurn(turn, "stopped", {});
    } else if (msg.type === "error") {
      finishTurn(turn, "error", { message: msg.error.message });
    }
  }

  // ---- the conversation ----

  function addMessage(role, text) {
    const box = el("div", "msg " + role);
    box.append(el("div", "role", role));
    const body = el("div", "body");
    if (role === "user") body.append(el("div", "text", text));
    box.append(body);
    $("log").append(box);
    scrollToEnd();
    return box;
  }

  // The answer as shown: the reasoning quoted above it, each tool call below it (the history keeps the answer).
  function shown(turn) {
    const quoted = turn.reasoning ? turn.reasoning.split("\n").map((line) => "> " + line).join("\n") + "\n\n" : "";
    const calls = turn.calls.filter(Boolean).map((c) => "\n\n`" + c.name + "(" + c.arguments + ")`").join("");
    return quoted + turn.text + calls;
  }

  function scheduleRender(turn) {
    if (turn.renderPending) return;
    turn.renderPending = true;
    requestAnimationFrame(() => {
      turn.renderPending = false;
      renderMarkdown(turn.body, shown(turn));
      turn.view.dataset.state = turn.status;
      turn.view.dataset.tokens = String(turn.tokens);
      scrollToEnd();
    });
  }

  function readNumber(id, { integer = false, min = -Infinity, max = Infinity } = {}) {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const value = Number(raw);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value)) || value < min || value > max) {
      throw new Error(`${id}: ${JSON.stringify(raw)} is not a valid value`);
    }
    return value;
  }

  function readParams() {
    const params = {
      temperature: readNumber("temperature", { min: 0 }),
      top_p: readNumber("top_p"),
      max_tokens: readNumber("max_tokens", { integer: true, min: 1 }),
      seed: readNumber("seed", { integer: true }),
    };
    const stop = $("stop_strings").value.split("\n").filter((s) => s !== "");
    if (stop.length) params.stop = stop;
    for (const k of Object.keys(params)) if (params[k] === undefined) delete params[k];
    return params;
  }

  async function send(text) {
    if (state.turn) return;
    let params;
    try {
      params = readParams();
    } catch (err) {
      setConn(err.message, "error");
      return;
    }
    const user = { role: "user", content: text };
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history, user);
    addMessage("user", text);
    const view = addMessage("assistant", "");
    const turn = {
      id: state.nextId++, view, body: view.querySelector(".body"), user, text: "", reasoning: "", calls: [], tokens: 0,
      tSend: performance.now(), tFirst: null, tLast: null, status: "waiting", ws: null, renderPending: false,
    };
    view.dataset.state = "waiting";
    state.turn = turn;
    $("send").disabled = true;
    $("stop").disabled = false;
    let ws;
    try {
      ws = await connect();
    } catch (err) {
      finishTurn(turn, "error", { message: err.message });
      loadModels(); // says whether a key is needed
      return;
    }
    if (state.turn !== turn) return; // stopped while connecting
    turn.ws = ws;
    turn.status = "streaming";
    view.dataset.state = "streaming";
    const model = $("model").value;
    ws.send(JSON.stringify({ type: "generate", id: turn.id, ...(model ? { model } : {}), messages, ...params }));
    refreshStatsSoon();
  }

  function stop() {
    const turn = state.turn;
    if (!turn) return;
    if (turn.ws && turn.ws.readyState === WebSocket.OPEN) {
      turn.ws.send(JSON.stringify({ type: "cancel", id: turn.id }));
      $("stop").disabled = true; // the server answers "cancelled"
    } else {
      finishTurn(turn, "stopped", {});
    }
  }

  function fmt(value, digits) {
    return value === null || value === undefined || !Number.isFinite(value) ? "–" : value.toFixed(digits);
  }

  function finishTurn(turn, status, { usage, finish, message }) {
    if (state.turn !== turn) return;
    state.turn = null;
    turn.status = status;
    renderMarkdown(turn.body, shown(turn));
    const view = turn.view;
    view.dataset.state = status;
    view.dataset.tokens = String(turn.tokens);
    const meta = el("div", "meta");
    const item = (key, text, raw) => {
      const span = el("span", "", text);
      span.dataset.stat = key;
      span.dataset.value = raw === null || raw === undefined ? "" : String(raw);
      meta.append(span);
    };
    const statusText = {
      done: "done" + (finish ? ` (${finish})` : ""), stopped: "stopped", error: "error: " + (message || "failed"),
    }[status];
    item("status", statusText, status);
    meta.firstChild.classList.add("status");
    const ttft = turn.tFirst === null ? null : turn.tFirst - turn.tSend;
    item("ttft_ms", `TTFT ${fmt(ttft, 0)} ms`, ttft);
    const completion = usage ? usage.completion_tokens : turn.tokens;
    // Decode speed: the tokens after the first over the time after the first.
    const span = turn.tLast !== null && turn.tFirst !== null ? (turn.tLast - turn.tFirst) / 1000 : 0;
    const rate = completion > 1 && span > 0 ? (completion - 1) / span : null;
    item("tokens_per_s", `${fmt(rate, 1)} tok/s`, rate);
    if (usage) {
      const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      item("prompt_tokens", `prompt ${usage.prompt_tokens}`, usage.prompt_tokens);
      item("cached_tokens", `cached ${cached}`, cached);
      item("completion_tokens", `completion ${usage.completion_tokens}`, usage.completion_tokens);
    } else if (status !== "error") {
      item("completion_tokens", `completion ${turn.tokens}`, turn.tokens);
    }
    view.append(meta);
    if (status !== "error") {
      state.history.push(turn.user, { role: "assistant", content: turn.text });
    }
    $("send").disabled = false;
    $("stop").disabled = true;
    refreshStatsSoon();
    scrollToEnd();
    $("input").focus();
  }

  function newConversation() {
    const turn = state.turn;
    if (turn) { // drop the answer in progress: it belongs to the old conversation
      if (turn.ws && turn.ws.readyState === WebSocket.OPEN) turn.ws.send(JSON.stringify({ type: "cancel", id: turn.id }));
      state.turn = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
    state.history = [];
    $("log").replaceChildren();
  }

  // ---- the live server panel ----

  function statRow(list, key, label, value, raw) {
    const dt = el("dt", "", label);
    const dd = el("dd", "", value);
    dd.dataset.stat = key;
    dd.dataset.value = raw === null || raw === undefined ? "" : String(raw);
    list.append(dt, dd);
  }

  function renderStats(body) {
    const cards = [];
    for (const m of body.models) {
      const card = el("div", "model-card");
      card.dataset.model = m.model;
      const title = el("h3", "", m.model);
      const badge = el("span", "state", m.state);
      badge.dataset.healthy = String(m.healthy);
      title.append(badge);
      card.append(title);
      const e = m.engine;
      const list = el("dl");
      const served = Object.values(m.requests).reduce((a, b) => a + b, 0);
      if (e) {
        statRow(list, "running", "running", String(e.running), e.running);
        statRow(list, "waiting", "waiting", String(e.waiting), e.waiting);
        statRow(list, "kv_blocks_used", "KV blocks", `${e.kv_blocks_used} / ${e.kv_blocks_total}`, e.kv_blocks_used);
        statRow(list, "kv_blocks_cached", "cached blocks", String(e.kv_blocks_cached), e.kv_blocks_cached);
        statRow(list, "prefix_cache_hit_rate", "prefix hits", `${fmt(100 * e.prefix_cache_hit_rate, 1)} %`,
                e.prefix_cache_hit_rate);
        statRow(list, "generation_tokens_per_s", "gen tok/s", fmt(e.generation_tokens_per_s, 1),
                e.generation_tokens_per_s);
        statRow(list, "num_preemptions", "preemptions", String(e.num_preemptions), e.num_preemptions);
      } else {
        statRow(list, "running", "engine", "no steps yet", null);
      }
      statRow(list, "requests", "requests done", String(served), served);
      card.append(list);
      if (e) {
        const bar = el("div", "bar");
        const fill = el("div");
        fill.style.width = `${e.kv_blocks_total ? (100 * e.kv_blocks_used) / e.kv_blocks_total : 0}%`;
        bar.append(fill);
        bar.title = "KV blocks in use";
        card.insertBefore(bar, list);
      }
      cards.push(card);
    }
    $("stats").replaceChildren(...cards);
  }

  let statsInFlight = false;

  async function pollStats() {
    clearTimeout(state.statsTimer);
    if (statsInFlight) return; // the request in flight schedules the next poll
    statsInFlight = true;
    try {
      const response = await fetch("/stats", { headers: authHeaders(), cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      renderStats(await response.json());
      $("stats-age").textContent = "live";
    } catch (err) {
      $("stats-age").textContent = "unreachable";
    } finally {
      statsInFlight = false;
    }
    const delay = document.hidden ? 5000 : state.turn ? 400 : 1000;
    state.statsTimer = setTimeout(pollStats, delay);
  }

  function refreshStatsSoon() {
    clearTimeout(state.statsTimer);
    state.statsTimer = setTimeout(pollStats, 150);
  }

  // ---- wiring ----

  async function start() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("input").value;
      if (!text.trim() || state.turn) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape") stop();
    });
    $("clear").addEventListener("click", newConversation);
    $("keybar").addEventListener("submit", async (event) => {
      event.preventDefault();
      const key = $("apikey").value;
      if (!key) return;
      state.key = key;
      if (await loadModels()) {
        $("apikey").value = "";
        connect().catch(() => {});
      }
    });
    pollStats();
    if (await loadModels()) connect().catch(() => {});
  }

  start();
})();
