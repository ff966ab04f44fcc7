#!/usr/bin/env node
// Streams one chat completion from the pdserve router (pdserve.v1.Generation/Generate).
//
//   node client.js [ROUTER_ADDRESS] [PROMPT] [--top-p P] [--temperature T] [--max-tokens N] [--text]
//
// ROUTER_ADDRESS defaults to $PDSERVE_ROUTER, else localhost:50051; PROMPT to
// "What is the capital of France?". The request is greedy (temperature 0) with max_tokens 32
// and a 120 s deadline unless the flags say otherwise; --text sends the prompt as plain text
// instead of a one-message chat. The generated text goes to stdout as it streams; usage and
// the finish reason go to stderr. On a gRPC error it prints the status name and details to
// stderr and exits 1 (2 for a usage error).
//
// The .proto files are loaded at run time from ../../protos (or $PDSERVE_PROTOS): no
// generated code.
'use strict';

const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = process.env.PDSERVE_PROTOS || path.resolve(__dirname, '..', '..', 'protos');
const DEFAULT_PROMPT = 'What is the capital of France?';
const DEADLINE_MS = 120_000;

function usage(message) {
  if (message) process.stderr.write(`error: ${message}\n`);
  process.stderr.write('usage: node client.js [ROUTER_ADDRESS] [PROMPT] [--top-p P] [--temperature T] ' +
                       '[--max-tokens N] [--text]\n');
  process.exit(2);
}

function number(name, value, fallback) {
  if (value === undefined) return fallback;
  const n = Number(value);
  if (value.trim() === '' || !Number.isFinite(n)) usage(`--${name} needs a number, got ${JSON.stringify(value)}`);
  return n;
}

function parseCommandLine() {
  let parsed;
  try {
    parsed = parseArgs({
      allowPositionals: true,
      options: {
        'top-p': { type: 'string' },
        temperature: { type: 'string' },
        'max-tokens': { type: 'string' },
        text: { type: 'boolean', default: false },
        help: { type: 'boolean', short: 'h', default: false },
      },
    });
  } catch (e) {
    usage(e.message);
  }
  const { values, positionals } = parsed;
  if (values.help) {
    process.stdout.write('usage: node client.js [ROUTER_ADDRESS] [PROMPT] [--top-p P] [--temperature T] ' +
                         '[--max-tokens N] [--text]\n');
    process.exit(0);
  }
  if (positionals.length > 2) usage('too many arguments (quote the prompt)');
  return {
    address: positionals[0] || process.env.PDSERVE_ROUTER || 'localhost:50051',
    prompt: positionals.length > 1 ? positionals[1] : DEFAULT_PROMPT,
    asText: values.text,
    params: {
      temperature: number('temperature', values.temperature, 0),
      top_p: number('top-p', values['top-p'], 0), // 0 = unset = 1.0 (off)
      max_tokens: number('max-tokens', values['max-tokens'], 32),
    },
  };
}

function loadGenerationService() {
  const definition = protoLoader.loadSync('pdserve/v1/router.proto', {
    includeDirs: [PROTO_ROOT], // resolves router.proto and its `import "pdserve/v1/common.proto"`
    keepCase: true,            // field names as in the .proto (max_tokens, finish_reason, ...)
    longs: String,             // uint64 (SamplingParams.seed) without precision loss
    enums: String,             // finish_reason as "FINISH_REASON_STOP", not 1
    defaults: true,            // unset scalars read as their proto3 default ("" / 0), not undefined
    oneofs: true,              // GenerateRequest.input names the member that is set
  });
  return grpc.loadPackageDefinition(definition).pdserve.v1.Generation;
}

function main() {
  const args = parseCommandLine();
  const Generation = loadGenerationService();
  const client = new Generation(args.address, grpc.credentials.createInsecure());

  const request = { params: args.params };
  if (args.asText) request.text = args.prompt;
  else request.chat = { messages: [{ role: 'user', content: args.prompt }] };

  const call = client.Generate(request, { deadline: Date.now() + DEADLINE_MS });
  let finished = false;
  let failed = false;
  let midLine = false; // text written and no newline yet
  process.once('SIGINT', () => call.cancel()); // the router cancels the request on the workers too

  call.on('data', (msg) => {
    process.stdout.write(msg.text);
    if (msg.text) midLine = !msg.text.endsWith('\n');
    if (msg.finish_reason && msg.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      finished = true;
      if (midLine) process.stdout.write('\n');
      midLine = false;
      const u = msg.usage || {};
      const stop = msg.matched_stop ? ` matched_stop=${JSON.stringify(msg.matched_stop)}` : '';
      process.stderr.write(`[${msg.request_id}] finish_reason=${msg.finish_reason}${stop} ` +
                           `prompt_tokens=${u.prompt_tokens} completion_tokens=${u.completion_tokens} ` +
                           `cached_tokens=${u.cached_tokens}\n`);
    }
  });
  call.on('error', (err) => { // every non-OK status ends here ('end' may still follow)
    failed = true;
    const name = grpc.status[err.code] || `code ${err.code}`;
    process.stderr.write(`${midLine ? '\n' : ''}error: ${name}: ${err.details}\n`);
    process.exitCode = err.code === grpc.status.CANCELLED ? 130 : 1;
  });
  call.on('end', () => { // after the last message has been read
    if (!failed && !finished) {
      process.stderr.write(`${midLine ? '\n' : ''}error: the stream ended without a finish reason\n`);
      process.exitCode = 1;
    }
  });
  call.on('status', () => client.close());
}

main();
