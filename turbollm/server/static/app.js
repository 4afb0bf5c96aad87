// The page's entry: reads /props, opens the stored conversations, shows the view the path names
// (/ → chat, /dashboard → dashboard) and switches views without reloading.

import {API} from "./api.js";
import {ChatView} from "./chat.js";
import {DashboardView} from "./dashboard.js";
import {Store} from "./store.js";

const $ = (id) => document.getElementById(id);

function banner(text, kind = "error") {
  const b = $("banner");
  b.textContent = text;
  b.className = `banner ${kind}`;
  b.hidden = false;
  const close = document.createElement("button");
  close.type = "button";
  close.className = "small";
  close.textContent = "Dismiss";
  close.addEventListener("click", () => { b.hidden = true; });
  b.appendChild(close);
}

async function main() {
  const api = new API();
  let props = null;
  try {
    props = await api.json("/props");
    $("model-name").textContent = `${props.model} · ${props.max_model_len} tokens`;
  } catch (e) {
    banner(`Could not read the server's settings (${e.message}); the server's defaults will apply.`);
  }
  const store = new Store(window.localStorage);
  const chat = new ChatView(api, store, props, banner);
  chat.showStoreProblems();
  const dash = new DashboardView(api, banner);
  window.turbollm = {chat, dash, store, api};  // for a console, and the browser test

  const show = (view) => {
    $("view-chat").hidden = view !== "chat";
    $("view-dashboard").hidden = view !== "dashboard";
    for (const a of document.querySelectorAll("nav a")) a.setAttribute("aria-current", a.dataset.view === view ? "page" : "false");
    if (view === "dashboard") dash.start(); else dash.stop();
  };
  const route = () => show(location.pathname.replace(/\/+$/, "").endsWith("/dashboard") ? "dashboard" : "chat");
  for (const a of document.querySelectorAll("nav a")) {
    a.addEventListener("click", (e) => {
      if (e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
      e.preventDefault();
      history.pushState(null, "", a.getAttribute("href"));
      route();
    });
  }
  window.addEventListener("popstate", route);
  $("toggle-sidebar").addEventListener("click", () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
  });
  route();
  document.body.dataset.ready = "1";
}

main();
