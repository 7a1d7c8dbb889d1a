// Drives an rlbus fleet with the official NATS JavaScript client, from docs/protocol.md alone:
// discover the controller, read server_info, pause, ask is_paused, tag a version and see it on
// rl.version, resume, generate, and show that a bad value is a typed refusal.
//   NATS_URL=nats://127.0.0.1:4222 RLBUS_PREFIX=rl node drive.mjs
import { connect } from "nats";
import { randomUUID } from "node:crypto";

const prefix = process.env.RLBUS_PREFIX || "rl";
const nc = await connect({ servers: process.env.NATS_URL || "nats://127.0.0.1:4222" });
const encode = (obj) => new TextEncoder().encode(JSON.stringify(obj));
const decode = (msg) => JSON.parse(new TextDecoder().decode(msg.data));

// one control op: a JSON object on rl.control.<op>; the answer is its reply kind or a nack
async function call(op, body = {}) {
  const msg = await nc.request(`${prefix}.control.${op}`, encode({ command_id: randomUUID(), ...body }), { timeout: 20000 });
  if (msg.headers?.get("Nats-Service-Error-Code")) {
    throw new Error(`BAD_REQUEST: ${msg.headers.get("Nats-Service-Error")}`);
  }
  const reply = decode(msg);
  if (reply.kind === "nack") throw Object.assign(new Error(`${reply.code}: ${reply.message}`), { code: reply.code });
  return reply;
}

const ping = decode(await nc.request("$SRV.PING.rlbus-controller", new Uint8Array(), { timeout: 5000 }));
console.log(`discovered ${ping.name}`);
const info = await call("server_info");
console.log(`workers ${info.workers.length} version ${info.weight_version} seq ${info.weight_seq}`);

const versions = nc.subscribe(`${prefix}.version`);
const paused = await call("pause", { mode: "wait" });
console.log(`paused ${paused.workers.every((w) => w.paused)}`);
console.log(`is_paused ${(await call("is_paused")).answer}`);

const tag = `js-${Date.now()}`;
await call("update_weight_version", { new_version: tag });
for await (const msg of versions) {
  const v = decode(msg);
  if (v.version === tag) { console.log(`published ${v.version} seq ${v.seq}`); break; }
}
await call("resume");
console.log(`is_paused ${(await call("is_paused")).answer}`);

const gen = decode(await nc.request(`${prefix}.generate`, encode({ prompt_tokens: [1, 2, 3], max_tokens: 4 }), { timeout: 20000 }));
console.log(`generated ${gen.tokens.length} tokens with ${gen.weight_version} seq ${gen.weight_seq}`);

try {
  await call("pause", { mode: "bogus" });
} catch (e) {
  console.log(`refused ${e.code}`);
}
await nc.drain();
