// The efftx playground: plain JavaScript, no framework, no build step.
//
// What the page talks to (all relative URLs, see efftx/serving/playground.py):
//   GET  models/info        which models are loaded, and the request limits (drawn as hints)
//   POST generate/stream    one decoding run as server-sent events; one stream per mode:
//                             event "step": {mode, step, text, draft_text, target_text,
//                                            drafted_accepted, from_target, tokens, elapsed_ms}
//                             event "done": {mode, text, tail, tokens, steps, latency_ms, tokens_per_s,
//                                            mean_accepted, acceptance_histogram, draft_calls, target_calls}
//                             event "error": {detail}
//   POST images/generate    {prompt, n, cond_scale, filter_thres, seed, response_format: "b64_json"}
//                             -> {images: [{b64_png, seed}], latency_ms, batch_size, size, ...}
//                             (an image/png body with an X-Latency-Ms header is understood too)
//
// A refused request answers 4xx with FastAPI's {detail: [{loc: ["body", FIELD], msg}]}: the message is
// shown under the input named FIELD, and the page stays usable.
//
// State the browser tests read: body[data-ready] ("yes" once models/info answered, or "error"),
// each column's data-state (idle | running | done | error | stopped), #match's class
// (identical | differ), and the .field-error elements.

"use strict";

const API = { info: "models/info", stream: "generate/stream", images: "images/generate" };

const $ = (selector, root = document) => root.querySelector(selector);
const $$ = (selector, root = document) => Array.from(root.querySelectorAll(selector));

let info = null;            // the answer of models/info
let textController = null;  // aborts the running text streams (the Stop button)

// ------------------------------------------------------------------------------------------------ formatting
function fmtCount(n) {
  if (n >= 1e9) return (n / 1e9).toFixed(2) + " B";
  if (n >= 1e6) return (n / 1e6).toFixed(2) + " M";
  if (n >= 1e3) return (n / 1e3).toFixed(1) + " k";
  return String(n);
}

function fmtMs(ms) {
  return ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : Math.round(ms) + " ms";
}

// Build an element: el("b", {className: "x"}, "text", child, ...)
function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

// ------------------------------------------------------------------------------------------------ forms + errors
// Read a form's named inputs into a JSON body. data-kind on an input says how to send it:
// "int"/"float" as numbers (left out when blank: the server's default applies), "int-or-empty" as a
// number or null (a blank seed = random), "bool" (a checkbox) as true/false. Textareas are sent as typed.
function formBody(form) {
  const body = {};
  const errors = [];
  for (const input of $$("input[name], textarea[name]", form)) {
    const kind = input.dataset.kind;
    const raw = input.value.trim();
    if (kind === "bool") {
      body[input.name] = input.checked;
    } else if (!kind) {
      body[input.name] = input.value;
    } else if (input.validity && input.validity.badInput) {  // the browser could not read a number
      errors.push({ field: input.name, msg: "not a number" });
    } else if (raw === "") {
      if (kind === "int-or-empty") body[input.name] = null;
    } else {
      body[input.name] = Number(raw);  // "4.5" for an int is sent as is: the server names the field
    }
  }
  return { body, errors };
}

// FastAPI's error body -> [{field, msg}]. A field is the last name in "loc" after "body"; errors about the
// body as a whole (bad JSON, not UTF-8) or in another shape go to the form ("_form").
async function responseErrors(response) {
  let detail;
  try {
    detail = (await response.json()).detail;
  } catch (_) {
    return [{ field: "_form", msg: `HTTP ${response.status} ${response.statusText}` }];
  }
  if (!Array.isArray(detail)) return [{ field: "_form", msg: String(detail) }];
  return detail.map((err) => {
    const names = (err.loc || []).filter((part) => typeof part === "string" && part !== "body");
    return { field: names.length ? names[names.length - 1] : "_form", msg: err.msg };
  });
}

function clearErrors(form) {
  for (const box of $$("[data-error-for]", form)) box.textContent = "";
  for (const input of $$(".invalid", form)) {
    input.classList.remove("invalid");
    input.removeAttribute("aria-invalid");
  }
}

// Show each error under its field (or at the form's foot when no input has that name).
function showErrors(form, errors) {
  const seen = new Set();
  for (const { field, msg } of errors) {
    if (seen.has(field + msg)) continue;  // both streams may refuse the same value
    seen.add(field + msg);
    const box = $(`[data-error-for="${field}"]`, form) || $('[data-error-for="_form"]', form);
    const input = $(`[name="${field}"]`, form);
    box.textContent = box.textContent ? box.textContent + "; " + msg : (input ? msg : `${field}: ${msg}`);
    if (input) {
      input.classList.add("invalid");
      input.setAttribute("aria-invalid", "true");
    }
  }
}

// ------------------------------------------------------------------------------------------------ server-sent events
// fetch() + a stream reader (EventSource only does GET). Yields {event, data} with data parsed as JSON.
async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {  // an event ends at a blank line
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

// ------------------------------------------------------------------------------------------------ text columns
// One output column (base or speculative): the streamed text, and its numbers.
class Column {
  constructor(article) {
    this.article = article;
    this.mode = article.dataset.mode;
    this.output = $("[data-output]", article);
    this.stats = $("[data-stats]", article);
  }

  set state(value) { this.article.dataset.state = value; }

  start() {
    this.output.textContent = "";
    this.stats.textContent = "starting…";
    this.steps = 0;
    this.drafted = 0;
    this.state = "running";
  }

  // One "step" event. In the speculative column the draft-accepted text and the target's token get
  // their own highlighted spans; the base column is plain text (every token is the target's).
  addStep(step) {
    if (this.mode === "speculative") {
      if (step.draft_text) {
        this.output.append(el("span", { className: "tok-draft", title: `${step.drafted_accepted} drafted tokens accepted` },
                              step.draft_text));
      }
      if (step.target_text) {
        this.output.append(el("span", { className: "tok-target", title: "produced by the target" }, step.target_text));
      }
    } else {
      this.output.append(step.text);
    }
    this.steps += 1;
    this.drafted += step.drafted_accepted;
    const rate = step.tokens / Math.max(step.elapsed_ms / 1000, 1e-9);
    let line = `${step.tokens} tokens · ${fmtMs(step.elapsed_ms)} · ${rate.toFixed(1)} tok/s`;
    if (this.mode === "speculative") line += ` · ${(this.drafted / this.steps).toFixed(2)} accepted/step`;
    this.stats.textContent = line + " …";
  }

  // The "done" event: final numbers from the server.
  finish(done) {
    if (done.tail) this.output.append(done.tail);  // an incomplete UTF-8 character at the very end
    this.stats.replaceChildren(
      "latency ", el("b", {}, fmtMs(done.latency_ms)),
      " · ", el("b", {}, done.tokens_per_s.toFixed(1)), " tok/s",
      ` · ${done.tokens} tokens in ${done.steps} steps`);
    if (this.mode === "speculative") {
      this.stats.append(
        " · mean accepted ", el("b", { className: "mean-accepted" }, done.mean_accepted.toFixed(2)),
        ` / step · histogram [${done.acceptance_histogram.join(", ")}]`,
        ` · ${done.target_calls} target / ${done.draft_calls} draft passes`);
    }
    this.state = "done";
  }

  fail(message, state = "error") {
    this.stats.textContent = message;
    this.state = state;
  }

  reset(message = "") {
    this.output.textContent = "";
    this.stats.textContent = message;
    this.state = "idle";
  }
}

const columns = {};  // mode -> Column, filled in start()

// Run one mode's stream into its column. Returns {done} or {errors}; throws AbortError when stopped.
async function runMode(mode, body, signal) {
  const column = columns[mode];
  column.start();
  // gamma (checked in every mode) and adaptive_gamma only matter to speculative decoding: the base stream leaves
  // them out, so an over-limit gamma refuses the speculative stream alone
  const { gamma, adaptive_gamma, ...baseBody } = body;
  const response = await fetch(API.stream, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(mode === "speculative" ? { ...body, mode } : { ...baseBody, mode }),
    signal,
  });
  if (!response.ok) {
    const errors = await responseErrors(response);
    column.fail("refused: " + errors.map((e) => `${e.field === "_form" ? "" : e.field + ": "}${e.msg}`).join("; "));
    return { errors };
  }
  for await (const { event, data } of serverSentEvents(response)) {
    if (event === "step") column.addStep(data);
    else if (event === "done") { column.finish(data); return { done: data }; }
    else if (event === "error") {
      column.fail(data.detail);
      return { errors: [{ field: "_form", msg: `${mode}: ${data.detail}` }] };
    }
  }
  column.fail("the stream ended before its last event");
  return { errors: [{ field: "_form", msg: `${mode}: the stream ended early` }] };
}

// The badge between form and columns: do the two finished columns hold the same text?
function showMatch(base, spec, temperature) {
  const badge = $("#match");
  const a = base.text, b = spec.text;
  if (a === b) {
    badge.className = "badge identical";
    badge.textContent = `✓ identical: speculative output = base output (${base.tokens} tokens)` +
      (temperature === 0 ? ", as greedy decoding guarantees" : "");
  } else {
    let i = 0;
    while (i < Math.min(a.length, b.length) && a[i] === b[i]) i += 1;
    badge.className = "badge differ";
    badge.textContent = `≠ the outputs differ from character ${i}` + (temperature === 0
      ? " (unexpected with greedy settings)"
      : " (expected when sampling: both follow the target's distribution but draw differently)");
  }
  badge.hidden = false;
}

async function onGenerateText(event) {
  event.preventDefault();
  const form = $("#text-form");
  clearErrors(form);
  $("#match").hidden = true;
  const { body, errors } = formBody(form);
  if (errors.length) { showErrors(form, errors); return; }

  const modes = info && info.speculative ? ["base", "speculative"] : ["base"];
  textController = new AbortController();
  $("#generate-text").disabled = true;
  $("#stop-text").disabled = false;
  try {
    let results = [];
    if ($("#sequential").checked) {
      for (const mode of modes) results.push(await runMode(mode, body, textController.signal));
    } else {  // side by side: both streams at once
      results = await Promise.all(modes.map((mode) => runMode(mode, body, textController.signal)));
    }
    showErrors(form, results.flatMap((r) => r.errors || []));
    if (results.length === 2 && results.every((r) => r.done)) {
      showMatch(results[0].done, results[1].done, body.temperature);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      for (const mode of modes) if (columns[mode].article.dataset.state === "running") columns[mode].fail("stopped", "stopped");
    } else {  // the server is unreachable, say
      showErrors(form, [{ field: "_form", msg: String(err) }]);
      for (const mode of modes) if (columns[mode].article.dataset.state === "running") columns[mode].fail(String(err));
    }
  } finally {
    textController = null;
    $("#generate-text").disabled = false;
    $("#stop-text").disabled = true;
  }
}

// ------------------------------------------------------------------------------------------------ images
async function onGenerateImages(event) {
  event.preventDefault();
  const form = $("#image-form");
  clearErrors(form);
  const { body, errors } = formBody(form);
  if (errors.length) { showErrors(form, errors); return; }
  const grid = $("#image-grid");
  const stats = $("#image-stats");
  const button = $("#generate-images");
  button.disabled = true;
  stats.textContent = "drawing…";
  const started = performance.now();
  try {
    const response = await fetch(API.images, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ ...body, response_format: "b64_json" }),
    });
    if (!response.ok) {
      showErrors(form, await responseErrors(response));
      stats.textContent = "";
      return;
    }
    let images, latency, batch = null;
    if ((response.headers.get("content-type") || "").startsWith("image/png")) {  // one bare PNG
      images = [{ src: URL.createObjectURL(await response.blob()), seed: body.seed }];
      latency = Number(response.headers.get("X-Latency-Ms"));
    } else {
      const data = await response.json();
      images = data.images.map((im) => ({ src: "data:image/png;base64," + im.b64_png, seed: im.seed }));
      latency = data.latency_ms;
      batch = data.batch_size;
    }
    const roundTrip = performance.now() - started;
    grid.replaceChildren(...images.map((im, i) => el("figure", {},
      el("img", { src: im.src, alt: `${body.prompt} (${i + 1})` }),
      el("figcaption", {}, im.seed === null || im.seed === undefined ? `image ${i + 1}` : `seed ${im.seed}`))));
    stats.textContent = `${images.length} image${images.length === 1 ? "" : "s"} in ${fmtMs(latency)} on the server ` +
      `(${fmtMs(roundTrip)} round trip)` + (batch > 1 ? ` · drawn in a batch of ${batch} requests` : "");
  } catch (err) {
    showErrors(form, [{ field: "_form", msg: String(err) }]);
    stats.textContent = "";
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------------------------------------ models + tabs
function selectTab(name) {
  for (const button of $$("#tabs [data-tab]")) button.setAttribute("aria-selected", String(button.dataset.tab === name));
  for (const section of $$("section.tab")) section.hidden = section.dataset.tab !== name;
}

function describeSource(card) {
  if (card.mlflow_model) return el("span", {}, `MLflow ${card.mlflow_model} v${card.mlflow_version} `, el("code", {}, card.source));
  return el("code", {}, card.source);
}

function showModels(data) {
  info = data;
  const rows = data.models.map((m) => el("tr", {},
    el("td", {}, m.role), el("td", {}, el("code", {}, m.id)), el("td", {}, m.recipe),
    el("td", { title: String(m.parameters) }, fmtCount(m.parameters)), el("td", {}, describeSource(m)),
    el("td", {}, Object.entries(m.details).map(([k, v]) => `${k} ${v}`).join(", "))));
  $("#models-table tbody").replaceChildren(...rows);
  const limits = data.image_limits ? { text: data.limits, images: data.image_limits } : { text: data.limits };
  $("#limits").textContent = JSON.stringify(limits, null, 2);

  // one line at the top: what is loaded
  const part = (m) => `${m.role} ${m.id} (${m.recipe}, ${fmtCount(m.parameters)} parameters)`;
  $("#models-summary").textContent = data.models.map(part).join(" · ");

  // limits as hints next to their fields
  const lim = { ...data.limits, ...(data.image_limits || {}) };
  lim.gamma = `${lim.min_gamma} to ${lim.max_gamma}`;
  for (const hint of $$("[data-limit]")) {
    const value = lim[hint.dataset.limit];
    if (value !== undefined) hint.textContent = hint.dataset.limit === "gamma" ? value : `≤ ${value}`;
  }

  if (!data.speculative) {
    columns.speculative.reset("no draft model on this server: base decoding only");
    $(".legend", columns.speculative.article).hidden = true;
  }
  // The Images tab exists only when the app has an image model; otherwise a short note says why.
  $("#images-tab-button").hidden = !data.images;
  $("#no-images-note").hidden = data.images;
}

async function start() {
  for (const article of $$(".column")) columns[article.dataset.mode] = new Column(article);
  for (const button of $$("#tabs [data-tab]")) button.addEventListener("click", () => selectTab(button.dataset.tab));
  $("#text-form").addEventListener("submit", onGenerateText);
  $("#stop-text").addEventListener("click", () => textController && textController.abort());
  $("#image-form").addEventListener("submit", onGenerateImages);
  // editing a field clears its error
  for (const input of $$("input[name], textarea[name]")) {
    input.addEventListener("input", () => {
      input.classList.remove("invalid");
      const box = $(`[data-error-for="${input.name}"]`, input.form);
      if (box) box.textContent = "";
    });
  }
  try {
    const response = await fetch(API.info);
    if (!response.ok) throw new Error(`models/info answered HTTP ${response.status}`);
    showModels(await response.json());
    document.body.dataset.ready = "yes";
  } catch (err) {
    $("#models-summary").textContent = `could not read models/info: ${err}`;
    document.body.dataset.ready = "error";
  }
}

document.addEventListener("DOMContentLoaded", start);
