"""vLLM's CPU build serving SmolLM2 in each dtype named (e.g. float32 bfloat16): start-up, then 8
requests of 64 greedy tokens at once; prints one JSON line per dtype. Run: .venv/bin/python
bench/vllm_cpu_dtype.py float32 bfloat16 (after `make smollm2`)."""
import os, subprocess, sys, time, json, requests, concurrent.futures as cf
ROOT=os.path.dirname(os.path.dirname(os.path.abspath(__file__))); M=f"{ROOT}/assets/smollm2-135m-instruct"
def run(dtype, port):
    env={**os.environ,"HF_HUB_OFFLINE":"1","VLLM_CPU_KVCACHE_SPACE":"1","VLLM_CACHE_ROOT":"/tmp/vllmcache"}
    t0=time.time()
    p=subprocess.Popen([f"{ROOT}/.venv-vllm/bin/python","-m","vllm.entrypoints.openai.api_server","--model",M,"--port",str(port),
        "--dtype",dtype,"--max-model-len","768","--enforce-eager"],env=env,stdout=open(f"/tmp/vllm-{dtype}.log","w"),stderr=subprocess.STDOUT,start_new_session=True)
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/models",timeout=1).ok: break
        except Exception: pass
        if p.poll() is not None: print("died"); return
        time.sleep(1)
    up=time.time()-t0
    def one(i):
        r=requests.post(f"http://127.0.0.1:{port}/v1/chat/completions",json={"model":M,"messages":[{"role":"user","content":f"What is {i}+{i*3}? Explain step by step."}],"max_tokens":64,"temperature":0},timeout=600)
        return r.json()["usage"]["completion_tokens"]
    t=time.time()
    with cf.ThreadPoolExecutor(8) as ex: toks=sum(ex.map(one,range(8)))
    dt=time.time()-t
    print(json.dumps({"dtype":dtype,"startup_s":round(up,1),"tokens":toks,"gen_s":round(dt,1),"tok_s":round(toks/dt,1)}),flush=True)
    os.killpg(p.pid,15); p.wait()
for d in sys.argv[1:]: run(d, 18000+len(d))
