// The playground: the ordinary OpenAI call a client makes (POST /v1/chat/completions with
// stream: true and stream_options.include_usage), its answer appended as text while it streams,
// with its token counts and rate. With API keys configured the key is typed here and kept in this
// page's memory only (the login cookie is HttpOnly: no script reads it).

export function playground(ui) {
  let known = "";
  let running = null;

  function clusters(list, auth) {
    ui.keyLabel.hidden = !auth;
    const names = list.map((c) => c.name).join("\n");
    if (names === known) return;
    known = names;
    const chosen = ui.cluster.value;
    ui.cluster.replaceChildren(...list.map((c) => {
      const o = document.createElement("option");
      o.value = c.name;
      o.textContent = `${c.name} (${c.model})`;
      return o;
    }));
    if (list.some((c) => c.name === chosen)) ui.cluster.value = chosen;
  }

  function stats(text) { ui.stats.textContent = text; }

  async function ask(event) {
    event.preventDefault();
    if (running) return;
    const controller = new AbortController();
    running = controller;
    ui.send.disabled = true;
    ui.stop.disabled = false;
    ui.answer.textContent = "";
    ui.answer.dataset.state = "streaming";
    const started = performance.now();
    let first = null;
    let chunks = 0;
    let usage = null;
    const headers = { "content-type": "application/json" };
    if (ui.key.value) headers.authorization = `Bearer ${ui.key.value}`;
    const body = {
      model: ui.cluster.value, stream: true, stream_options: { include_usage: true },
      max_tokens: Number(ui.max.value) || 64, messages: [{ role: "user", content: ui.prompt.value }],
    };
    stats("asking…");
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body),
        signal: controller.signal, credentials: "omit" });
      if (!r.ok) {
        let message = `${r.status} ${r.statusText}`;
        try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
        throw new Error(message);
      }
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message);
            if (chunk.usage) usage = chunk.usage;
            const text = chunk.choices && chunk.choices[0] && chunk.choices[0].delta && chunk.choices[0].delta.content;
            if (text) {
              if (first === null) first = performance.now();
              chunks += 1;
              ui.answer.append(document.createTextNode(text));
              stats(`${chunks} chunks so far · first after ${Math.round(first - started)} ms`);
            }
          }
        }
      }
      // The rate over the whole answer, first token included: a fast model's last tokens can
      // arrive in one read, and a rate after the first would then be meaningless.
      const secs = (performance.now() - started) / 1000;
      const tokens = usage ? usage.completion_tokens : chunks;
      ui.answer.dataset.state = "done";
      stats(`${usage ? `${usage.prompt_tokens} prompt tokens · ` : ""}${tokens} completion tokens` +
        (first !== null ? ` · first after ${Math.round(first - started)} ms` : "") +
        ` · ${secs.toFixed(2)} s in all · ${(tokens / secs).toFixed(1)} tokens/s`);
    } catch (e) {
      ui.answer.dataset.state = "failed";
      stats(e.name === "AbortError" ? "stopped" : `failed: ${e.message}`);
    } finally {
      running = null;
      ui.send.disabled = false;
      ui.stop.disabled = true;
    }
  }

  ui.form.addEventListener("submit", ask);
  ui.stop.addEventListener("click", () => running && running.abort());
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) ui.form.requestSubmit();
  });
  return { clusters };
}
