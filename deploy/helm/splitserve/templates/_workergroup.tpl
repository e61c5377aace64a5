{{/*
One worker group of the RayCluster: each pod holds one replica of the pool (its TP or EP ranks
on the pod's GPUs) and advertises one slot of the pool's Ray resource, splitserve_<pool>, so
the controller places that pool's replicas only here. Called with dict root, pool, size.
*/}}
{{- define "splitserve.workerGroup" -}}
{{- $v := .root.Values }}
{{- $p := index $v .pool }}
{{- $gpus := ternary .size 0 (gt (int $v.gpusPerNode) 0) -}}
- groupName: {{ .pool }}
  replicas: {{ $p.replicas }}
  minReplicas: {{ $p.minReplicas }}
  maxReplicas: {{ $p.maxReplicas }}
  rayStartParams:
    num-cpus: {{ $p.cpus | quote }}
    num-gpus: {{ $gpus | quote }}
    resources: {{ printf "\"{\\\"splitserve_%s\\\": 1}\"" .pool | squote }}
  template:
    metadata:
      labels:
        {{- include "splitserve.labels" .root | nindent 8 }}
        app.kubernetes.io/component: {{ .pool }}
    spec:
      # The worker drains its replica on SIGTERM (in-flight requests finish) before it leaves.
      terminationGracePeriodSeconds: {{ add $p.drainTimeoutS 30 }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.clusterTLS.enabled }}
      {{- include "splitserve.clusterTLS.initContainers" (dict "root" .root "dns" list) | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "splitserve.image" .root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["splitserve"]
          args:
            - worker
            - --pool
            - {{ .pool }}
            - --address
            - $(FQ_RAY_IP):6379
            - --num-gpus
            - {{ $gpus | quote }}
            - --num-cpus
            - {{ $p.cpus | quote }}
            - --drain-timeout-s
            - {{ $p.drainTimeoutS | quote }}
            {{- if $v.clusterTLS.enabled }}
            {{- include "splitserve.clusterTLS.args" .root | nindent 12 }}
            {{- end }}
          ports:
            - name: metrics
              containerPort: {{ $p.metricsPort }}
          # Ready once the controller has started this pod's replica (its metrics endpoint is
          # up): the planner counts a group's Ready pods as its warm replicas.
          readinessProbe:
            tcpSocket:
              port: metrics
            periodSeconds: 10
            failureThreshold: 3
          env:
            {{- include "splitserve.env" .root | nindent 12 }}
            {{- with include "splitserve.gcsReconnectEnv" .root }}
            {{- . | nindent 12 }}
            {{- end }}
          resources:
            requests:
              cpu: {{ $p.cpus | quote }}
              memory: {{ $p.memory }}
              {{- if $gpus }}
              nvidia.com/gpu: {{ $gpus | quote }}
              {{- end }}
            limits:
              cpu: {{ $p.cpus | quote }}
              memory: {{ $p.memory }}
              {{- if $gpus }}
              nvidia.com/gpu: {{ $gpus | quote }}
              {{- end }}
          volumeMounts:
            {{- include "splitserve.volumeMounts" .root | nindent 12 }}
      volumes:
        {{- include "splitserve.volumes" (dict "root" .root "shmSize" $p.shmSize) | nindent 8 }}
      {{- with $p.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
