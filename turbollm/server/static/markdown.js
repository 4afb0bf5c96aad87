// A small Markdown renderer for model replies: fenced code blocks (highlighted, with a copy button),
// headings, lists, block quotes, rules, paragraphs; inline code, bold, italic, links (http/https only).
// Every piece of text is HTML-escaped before any markup is added, so a reply cannot inject HTML.
// An unclosed fence (a reply still streaming) renders as a code block up to the end.

export function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
          .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

const KEYWORDS = new Set((
  "and as assert async await break case catch class const continue def default del do elif else enum " +
  "except export extends false False finally fn for from func function go if impl import in interface is " +
  "lambda let loop match mod mut new nil None nonlocal not null or package pass pub raise return self " +
  "static struct super switch this throw true True try type typeof use var void while with yield " +
  "int float double char bool long short unsigned signed auto string str echo then fi done esac local"
).split(" "));
const HASH_COMMENT = new Set(["py", "python", "sh", "bash", "shell", "zsh", "rb", "ruby", "r", "yaml", "yml",
                              "toml", "perl", "make", "makefile", "dockerfile", "ini", "conf"]);

// Code → HTML with <span class="tok-…"> around comments, strings, numbers and keywords.
export function highlight(code, lang) {
  const l = (lang || "").toLowerCase();
  const hash = HASH_COMMENT.has(l);
  const slash = !hash || l === "";
  const parts = [
    "(" + (hash ? "#[^\\n]*" : "") + (hash && slash ? "|" : "") + (slash ? "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?\\*\\/" : "") + ")",
    "(\"\"\"[\\s\\S]*?\"\"\"|'''[\\s\\S]*?'''|\"(?:\\\\.|[^\"\\\\\\n])*\"|'(?:\\\\.|[^'\\\\\\n])*'|`(?:\\\\.|[^`\\\\])*`)",
    "(\\b\\d[\\d_]*(?:\\.\\d+)?(?:e[+-]?\\d+)?\\b|\\b0x[0-9a-f]+\\b)",
    "([A-Za-z_][A-Za-z0-9_]*)",
  ];
  const re = new RegExp(parts.join("|"), "gi");
  let out = "", last = 0, m;
  while ((m = re.exec(code)) !== null) {
    out += escapeHtml(code.slice(last, m.index));
    const text = escapeHtml(m[0]);
    if (m[1]) out += `<span class="tok-comment">${text}</span>`;
    else if (m[2]) out += `<span class="tok-string">${text}</span>`;
    else if (m[3]) out += `<span class="tok-number">${text}</span>`;
    else if (KEYWORDS.has(m[4])) out += `<span class="tok-keyword">${text}</span>`;
    else out += text;
    last = re.lastIndex;
  }
  return out + escapeHtml(code.slice(last));
}

function safeUrl(url) {
  return /^https?:\/\//i.test(url) ? url : null;
}

// Inline markup of one line or paragraph (already split into blocks).
export function renderInline(text) {
  const codes = [];
  // code spans first: their content is literal
  let s = text.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return `\u0000${codes.length - 1}\u0000`; });
  s = escapeHtml(s);
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) => {
    const u = safeUrl(url.replace(/&amp;/g, "&"));
    return u ? `<a href="${escapeHtml(u)}" target="_blank" rel="noopener noreferrer">${label}</a>` : all;
  });
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>").replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${escapeHtml(codes[+i])}</code>`);
}

function codeBlock(code, lang) {
  const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "";
  return `<div class="code-block"><div class="code-head">${label}` +
         `<button type="button" class="copy-code" data-testid="copy-code" aria-label="Copy code">Copy</button></div>` +
         `<pre><code data-lang="${escapeHtml(lang || "")}">${highlight(code, lang)}</code></pre></div>`;
}

// Markdown source → HTML.
export function renderMarkdown(src) {
  const lines = src.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = [];
  const flush = () => {
    if (para.length) out.push(`<p>${para.map(renderInline).join("<br>")}</p>`);
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flush();
      const body = [];
      let j = i + 1;
      while (j < lines.length && !lines[j].trim().startsWith(fence[1])) body.push(lines[j++]);
      out.push(codeBlock(body.join("\n"), fence[2]));
      i = j;  // the closing fence (or the end, when the reply is still streaming)
      continue;
    }
    const h = line.match(/^(#{1,6})\s+(.*)$/);
    if (h) {  // "#" → h3: a heading inside a message stays below the page's own
      flush();
      const lv = Math.min(6, h[1].length + 2);
      out.push(`<h${lv}>${renderInline(h[2])}</h${lv}>`);
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); out.push("<hr>"); continue; }
    if (/^\s*>/.test(line)) {
      flush();
      const quote = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quote.push(lines[i++].replace(/^\s*>\s?/, ""));
      i--;
      out.push(`<blockquote>${renderMarkdown(quote.join("\n"))}</blockquote>`);
      continue;
    }
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (item) {
      flush();
      const ordered = /\d/.test(item[1]);
      const items = [];
      while (i < lines.length) {
        const it = lines[i].match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
        if (it && /\d/.test(it[1]) === ordered) items.push(it[2]);
        else if (items.length && /^\s{2,}\S/.test(lines[i])) items[items.length - 1] += "\n" + lines[i].trim();
        else break;
        i++;
      }
      i--;
      const tag = ordered ? "ol" : "ul";
      const start = ordered ? parseInt(item[1], 10) : 1;
      out.push(`<${tag}${ordered && start !== 1 ? ` start="${start}"` : ""}>` +
               items.map((t) => `<li>${t.split("\n").map(renderInline).join("<br>")}</li>`).join("") + `</${tag}>`);
      continue;
    }
    if (line.trim() === "") { flush(); continue; }
    para.push(line);
  }
  flush();
  return out.join("\n");
}
