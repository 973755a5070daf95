// moe-server's chat page in headless Chromium, as a person uses it:
//   node test/clients/chat-page.mjs BASE_URL SCREENSHOT.png [CHROMIUM]
// Loads the page, sends a message, waits for the streamed reply and its tokens/s, takes a
// screenshot; then sends another and stops it mid-reply (both at temperature 0: see below). Prints "N checks, N failed" last and
// exits 1 if any failed.
import puppeteer from "puppeteer-core";

const [base, shot, chromium = "/usr/bin/chromium"] = process.argv.slice(2);
let checks = 0, failed = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failed++; console.log("FAILED: " + what); }
}

const browser = await puppeteer.launch({ executablePath: chromium, headless: true, args: ["--no-sandbox", "--disable-gpu"] });
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1000, height: 700 });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  // the page's requests sent at temperature 0, so that its replies are the same every run: the
  // first ends by itself (140 tokens on the shipped model), the second runs for thousands
  await page.setRequestInterception(true);
  page.on("request", (req) => {
    if (req.method() !== "POST" || !req.url().endsWith("/v1/chat/completions")) return req.continue();
    const body = JSON.parse(req.postData());
    body.temperature = 0;
    req.continue({ postData: JSON.stringify(body) });
  });
  const resp = await page.goto(base + "/", { waitUntil: "load" });
  check(resp.status() === 200, "GET / " + resp.status());
  await page.waitForFunction(() => document.getElementById("model").textContent.length > 0, { timeout: 10000 });

  // a message and its streamed reply, finished when the tokens/s line shows
  await page.type("#input", "Tell me about the sea");
  await page.click("#send");
  await page.waitForFunction(() => {
    const s = document.querySelector(".assistant .stats");
    return s && /tokens\/s/.test(s.textContent);
  }, { timeout: 60000 });
  const reply = await page.evaluate(() => {
    const a = document.querySelector(".assistant");
    const d = a.querySelector("details");
    return { user: document.querySelector(".user").textContent, content: a.children[1].textContent, stats: a.querySelector(".stats").textContent,
             reasoning: d.style.display !== "none" ? d.querySelector("div").textContent : "", folded: !d.open,
             rate: document.getElementById("rate").textContent };
  });
  check(reply.user === "Tell me about the sea", "the user's message: " + reply.user);
  check(reply.content.length + reply.reasoning.length > 20, "the reply: " + JSON.stringify(reply));
  check(reply.reasoning.length === 0 || reply.folded, "the reasoning is folded away: " + JSON.stringify(reply));
  check(/^\d+ tokens, [\d.]+ tokens\/s$/.test(reply.stats) && /tokens\/s/.test(reply.rate), "tokens/s: " + reply.stats + " / " + reply.rate);
  await page.screenshot({ path: shot });

  // a second message, stopped mid-reply: the page says so and takes a new message
  await page.type("#input", "Count to one thousand");
  await page.click("#send");
  await page.waitForFunction(() => document.querySelectorAll(".assistant").length === 2 &&
    document.querySelectorAll(".assistant")[1].textContent.length > 0, { timeout: 30000 });
  await page.click("#stop");
  await page.waitForFunction(() => !document.getElementById("send").disabled, { timeout: 10000 });
  const stopped = await page.evaluate(() => document.querySelectorAll(".assistant")[1].querySelector(".stats").textContent);
  check(stopped === "stopped", "after Stop: " + stopped);
  check(errors.length === 0, "page errors: " + errors.join("; "));
} finally {
  await browser.close();
}
console.log(checks + " checks, " + failed + " failed");
process.exit(failed ? 1 : 0);
