{{/*
A GPU stage's Job, as the orchestrator creates it for a run (eyrie/work/k8s_jobs.py build_job adds the
run's name, labels and `suspend: true`). Called with (dict "root" $ "stage" NAME "spec" VALUES).
Every GPU workload carries Kueue's queue label and requests its GPUs: Kueue admits it when the
ClusterQueue's quota has room, which on one host is the Redis lease's job.
*/}}
{{- define "eyrie.gpuJob" -}}
{{- $root := .root -}}{{- $stage := .stage -}}{{- $spec := .spec -}}{{- $common := $root.Values.gpuJobs.common -}}
{{- $full := include "eyrie.fullname" $root -}}
apiVersion: batch/v1
kind: Job
metadata:
  labels:
    {{- include "eyrie.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $stage }}
    kueue.x-k8s.io/queue-name: {{ $root.Values.kueue.localQueue.name }}
spec:
  parallelism: {{ $spec.parallelism | default 1 }}
  backoffLimit: {{ $common.backoffLimit }}
  ttlSecondsAfterFinished: {{ $common.ttlSecondsAfterFinished }}
  template:
    metadata:
      labels:
        {{- include "eyrie.selector" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $stage }}
    spec:
      serviceAccountName: {{ include "eyrie.serviceAccount" $root }}
      restartPolicy: Never
      terminationGracePeriodSeconds: {{ $spec.terminationGracePeriodSeconds }}
      securityContext:
        {{- include "eyrie.podSecurity" $root | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets: {{ toJson . }}
      {{- end }}
      {{- with $common.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with (merge (dict) ($spec.nodeSelector | default dict) ($common.nodeSelector | default dict)) }}
      nodeSelector: {{ toJson . }}
      {{- end }}
      {{- with (concat ($common.tolerations | default list) ($spec.tolerations | default list)) }}
      tolerations: {{ toJson . }}
      {{- end }}
      containers:
        - name: {{ $stage }}
          image: {{ include "eyrie.image" (list $root (ternary "inference" $spec.image (eq $spec.image ""))) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- if eq $stage "extract" "train" "verify" }}
          command: ["python", "-m", "eyrie.tasks.gpu_admission", "drain", {{ $stage | quote }}]
          {{- else if eq $stage "extract-server" }}
          command: ["python3", "-m", "eyrie_extractor.vllm_backend"]
          args:
            - {{ required "model (the target) is required for gpuJobs.extractServer" $root.Values.model | quote }}
            - --layers
            - {{ required "gpuJobs.extractServer.layers is required (the run's aux layers, e.g. 2,30,58)" $spec.layers | quote }}
            - --shared-dir
            - /shared/eyrie-hs
            - --tensor-parallel-size
            - {{ $spec.gpus | quote }}
            - --host
            - 0.0.0.0
            - --port
            - "8000"
            - --exec
          {{- end }}
          env:
            {{- include "eyrie.env" $root | nindent 12 }}
            - name: EYRIE_JOB_RUN
              valueFrom:
                fieldRef: {fieldPath: "metadata.annotations['eyrie.dev/run-name']"}
            {{- if eq $stage "serve" }}
            - {name: EYRIE_SERVER, value: vllm}
            - {name: EYRIE_HOST, value: 0.0.0.0}
            - {name: EYRIE_PORT, value: "8000"}
            - {name: EYRIE_ADVERTISE_URL, value: {{ printf "http://%s-inference:8000" $full | quote }}}
            - {name: EYRIE_TENSOR_PARALLEL_SIZE, value: {{ $spec.gpus | quote }}}
            - {name: EYRIE_SERVE_DEADLINE_S, value: {{ $spec.deadlineSeconds | quote }}}
            {{- with $spec.reasoningParser }}
            - {name: EYRIE_REASONING_PARSER, value: {{ . | quote }}}
            {{- end }}
            {{- with $spec.vllmArgs }}
            - {name: EYRIE_VLLM_ARGS, value: {{ . | quote }}}
            {{- end }}
            {{- end }}
            {{- if eq $stage "train" }}
            - {name: EYRIE_CACHE_DIR, value: /cache/eyrie}
            {{- end }}
            {{- if and (eq $stage "extract" "train") $root.Values.gpuJobs.extractServer.enabled }}
            - {name: EYRIE_EXTRACT_VLLM_URL, value: {{ printf "http://%s-extract-server:8000" $full | quote }}}
            {{- end }}
          {{- if eq $stage "serve" "extract-server" }}
          ports:
            - {name: http, containerPort: 8000}
          readinessProbe:
            httpGet: {path: /v1/models, port: http}
            periodSeconds: 30
            failureThreshold: 3
          {{- end }}
          resources:
            requests:
              cpu: {{ $spec.cpu | quote }}
              memory: {{ $spec.memory | quote }}
              {{- if gt (int $spec.gpus) 0 }}
              nvidia.com/gpu: {{ $spec.gpus }}
              {{- end }}
            limits:
              memory: {{ $spec.memory | quote }}
              {{- if gt (int $spec.gpus) 0 }}
              nvidia.com/gpu: {{ $spec.gpus }}
              {{- end }}
          volumeMounts:
            {{- include "eyrie.jobsMount" $root | nindent 12 }}
            - {name: dshm, mountPath: /dev/shm}
            - {name: hf-cache, mountPath: /home/eyrie/.cache/huggingface}
            {{- if $root.Values.models.existingClaim }}
            - {name: models, mountPath: /models, readOnly: true}
            {{- end }}
            {{- if eq $stage "train" }}
            - {name: cache, mountPath: /cache/eyrie}
            {{- end }}
            {{- if and (eq $stage "extract" "extract-server" "train") $root.Values.gpuJobs.extractServer.enabled }}
            - {name: shared-hs, mountPath: /shared/eyrie-hs}
            {{- end }}
      volumes:
        {{- include "eyrie.jobsVolume" $root | nindent 8 }}
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ $common.shmSize | quote }}}
        - name: hf-cache
          {{- if $root.Values.models.hfCacheClaim }}
          persistentVolumeClaim: {claimName: {{ $root.Values.models.hfCacheClaim }}}
          {{- else }}
          emptyDir: {}
          {{- end }}
        {{- if $root.Values.models.existingClaim }}
        - name: models
          persistentVolumeClaim: {claimName: {{ $root.Values.models.existingClaim }}, readOnly: true}
        {{- end }}
        {{- if eq $stage "train" }}
        - name: cache
          {{- if $spec.cacheClaim }}
          persistentVolumeClaim: {claimName: {{ $spec.cacheClaim }}}
          {{- else }}
          emptyDir: {}
          {{- end }}
        {{- end }}
        {{- if and (eq $stage "extract" "extract-server" "train") $root.Values.gpuJobs.extractServer.enabled }}
        - name: shared-hs
          persistentVolumeClaim: {claimName: {{ required "gpuJobs.extractServer.sharedClaim (a ReadWriteMany PVC) is required" $root.Values.gpuJobs.extractServer.sharedClaim }}}
        {{- end }}
{{- end -}}
