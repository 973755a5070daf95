// moe-server spoken to by the official openai package, as an application would:
//   node test/clients/openai-client.mjs BASE_URL API_KEY MODEL_ID
// Prints one line per failed check and "N checks, N failed" last; exits 1 if any failed.
import OpenAI from "openai";

const [base, key, modelId] = process.argv.slice(2);
const client = new OpenAI({ baseURL: base + "/v1", apiKey: key, maxRetries: 0, timeout: 60000 });
let checks = 0, failed = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failed++; console.log("FAILED: " + what); }
}

// models
const models = await client.models.list();
check(models.data.length === 1 && models.data[0].id === modelId, "models.list: " + JSON.stringify(models.data));

// chat, whole and streamed: the same text, the usage, a finish reason
const messages = [{ role: "system", content: "You are brief." }, { role: "user", content: "Tell me about the sea." }];
const whole = await client.chat.completions.create({ model: modelId, messages, max_tokens: 24, temperature: 0 });
const wm = whole.choices[0].message;
check(whole.object === "chat.completion" && wm.role === "assistant" && typeof wm.content === "string", "chat: " + JSON.stringify(whole));
const wf = whole.choices[0].finish_reason, wn = whole.usage.completion_tokens;
check(wn > 0 && wn <= 24 && whole.usage.prompt_tokens > 0 && whole.usage.total_tokens === wn + whole.usage.prompt_tokens,
  "chat usage: " + JSON.stringify(whole.usage));
check(wf === (wn === 24 ? "length" : "stop"), "chat finish_reason: " + wf + " after " + wn + " tokens");

const stream = await client.chat.completions.create({
  model: modelId, messages, max_tokens: 24, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let content = "", reasoning = "", finish = null, usage = null, chunks = 0;
for await (const chunk of stream) {
  chunks++;
  check(chunk.object === "chat.completion.chunk" && chunk.id === chunk.id, "chunk object: " + chunk.object);
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    content += c.delta.content || "";
    reasoning += c.delta.reasoning_content || "";
    if (c.finish_reason) finish = c.finish_reason;
  }
}
check(chunks > 5, "chat stream: " + chunks + " chunks");
check(content === (wm.content || "") && reasoning === (wm.reasoning_content || ""),
  "streamed [" + reasoning + "|" + content + "] whole [" + wm.reasoning_content + "|" + wm.content + "]");
check(finish === wf && usage && usage.completion_tokens === wn, "stream end: " + finish + " " + JSON.stringify(usage));

// tools: the request is taken, and any call the model makes is well formed
const tools = [{ type: "function", function: { name: "get_weather", description: "The weather in a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];
for (const streamed of [false, true]) {
  const args = { model: modelId, max_tokens: 40, temperature: 0, tools, tool_choice: "auto",
    messages: [{ role: "user", content: "What is the weather in Paris?" }] };
  if (!streamed) {
    const r = await client.chat.completions.create(args);
    const c = r.choices[0];
    check(["stop", "length", "tool_calls"].includes(c.finish_reason), "tools finish_reason: " + c.finish_reason);
    for (const call of c.message.tool_calls || [])
      check(call.type === "function" && typeof call.function.name === "string" && typeof call.function.arguments === "string",
        "tool call: " + JSON.stringify(call));
  } else {
    let n = 0, fr = null;
    for await (const chunk of await client.chat.completions.create({ ...args, stream: true })) {
      n++;
      for (const c of chunk.choices) if (c.finish_reason) fr = c.finish_reason;
    }
    check(n > 1 && ["stop", "length", "tool_calls"].includes(fr), "tools stream: " + n + " chunks, " + fr);
  }
}

// text completions, whole and streamed
const prompt = "Once upon a time";
const comp = await client.completions.create({ model: modelId, prompt, max_tokens: 16, temperature: 0 });
check(comp.object === "text_completion" && comp.choices[0].text.length > 0 && comp.usage.completion_tokens === 16,
  "completion: " + JSON.stringify(comp));
let text = "";
for await (const chunk of await client.completions.create({ model: modelId, prompt, max_tokens: 16, temperature: 0, stream: true }))
  text += chunk.choices.length ? chunk.choices[0].text : "";
check(text === comp.choices[0].text, "streamed completion [" + text + "] whole [" + comp.choices[0].text + "]");

// errors arrive as the package's error classes
try {
  await new OpenAI({ baseURL: base + "/v1", apiKey: "wrong", maxRetries: 0 }).models.list();
  check(false, "a wrong key was accepted");
} catch (e) {
  check(e instanceof OpenAI.AuthenticationError && e.status === 401, "wrong key: " + e);
}
try {
  await client.chat.completions.create({ model: modelId, messages: [], max_tokens: 4 });
  check(false, "empty messages were accepted");
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.status === 400 && /messages/.test(e.message), "empty messages: " + e);
}

console.log(checks + " checks, " + failed + " failed");
process.exit(failed ? 1 : 0);
